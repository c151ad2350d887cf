"""Build hook of kvservice-client: the optional compiled block-hash chain.

``kvservice_client._hashchain`` (C, linked against OpenSSL's libcrypto) is built when a compiler
and the OpenSSL headers are present; ``optional=True`` makes a failed build a warning, and
``kvservice_client.hashing`` then uses its pure-Python rule, which is also the reference the
compiled path is tested against. Everything else is in pyproject.toml.
"""

import sys

# pip builds this package's metadata before it resolves the dependencies: say the Python is too
# old here, before pip looks for protobuf and grpcio releases for it and fails on those instead.
if sys.version_info < (3, 10):  # noqa: UP036 (the check runs on the Pythons requires-python excludes)
    sys.exit(
        f"kvservice-client needs Python 3.10 or newer (requires-python >=3.10); this is Python "
        f"{sys.version_info.major}.{sys.version_info.minor}: install it with python3.10 or newer"
    )

from setuptools import Extension, setup  # noqa: E402 (after the version check, which needs nothing)

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
