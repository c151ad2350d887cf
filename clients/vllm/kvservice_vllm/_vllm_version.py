"""The vLLM this package is built against, checked when ``kvservice_vllm`` is imported (this
module runs :func:`check_installed_vllm` on import, before any other module of the package).

vLLM is not a dependency of ``kvservice-vllm`` (``clients/vllm/pyproject.toml`` says why: an
install must never change the installed torch or vLLM), so the version is checked here: every
module of the package reads vLLM 0.33's internals (its scheduler, ``KVCacheManager`` surface,
offload tier API), which other minor versions change.
"""

from __future__ import annotations

SUPPORTED = "0.33"
"""vLLM's ``MAJOR.MINOR`` this package supports (any patch release of it)."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM other than 0.33.x.

    Args:
        version: ``vllm.__version__`` (e.g. ``"0.33.0"``, ``"0.33.1+cpu"``, ``"0.33.0rc1"``).

    Raises:
        ImportError: ``version`` is not a 0.33 release; the message names it, the supported
            version and the install command.
    """
    parts = version.split("+", 1)[0].split(".")
    if parts[:2] != SUPPORTED.split("."):
        raise ImportError(
            f"kvservice_vllm supports vLLM {SUPPORTED}.x; the installed vllm is {version} "
            f"(pip install 'vllm=={SUPPORTED}.*', or 'kvservice-vllm[vllm]')"
        )


def check_installed_vllm() -> None:
    """:func:`check_vllm_version` of the importable ``vllm`` (ImportError also when it is absent)."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"kvservice_vllm needs vLLM {SUPPORTED}.x, which is not installed "
            f"(pip install 'vllm=={SUPPORTED}.*', or 'kvservice-vllm[vllm]')"
        ) from exc
    check_vllm_version(vllm.__version__)


check_installed_vllm()
