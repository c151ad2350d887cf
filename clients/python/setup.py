"""Build hook of kvservice-client: the optional compiled block-hash chain.

``kvservice_client._hashchain`` (C, linked against OpenSSL's libcrypto) is built when a compiler
and the OpenSSL headers are present; ``optional=True`` makes a failed build a warning, and
``kvservice_client.hashing`` then uses its pure-Python rule, which is also the reference the
compiled path is tested against. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvservice_client._hashchain",
            ["kvservice_client/_hashchain.c"],
            libraries=["crypto"],
            optional=True,
        )
    ]
)
