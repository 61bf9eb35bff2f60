"""autoseg: self-configuring medical image segmentation that plans GPU and host memory in bytes."""

__version__ = "0.1.0"
