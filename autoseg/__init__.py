"""autoseg: self-configuring medical image segmentation that plans GPU and host memory in bytes.

``from autoseg import Segmenter`` (``autoseg.predict.segmenter``: a trained model in this process) is imported when
first asked for, so ``import autoseg`` alone loads neither torch nor SimpleITK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoseg.predict.segmenter import Segmenter

__version__ = "0.1.0"
__all__ = ["Segmenter", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Segmenter":
        from autoseg.predict.segmenter import Segmenter

        return Segmenter
    raise AttributeError(f"module 'autoseg' has no attribute {name!r}")
