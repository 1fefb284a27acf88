"""The frozen-encoder interface, its registry and the helpers every encoder shares.

An encoder turns raw media into float features in three steps, so that the CPU work can run in
DataLoader workers and only the network runs on the accelerator:

    x = enc.preprocess(modality, raw)    # per item, CPU: PIL.Image RGB / np.float32 mono wave / str
    b = enc.collate(modality, [x, ...])  # per batch, CPU: stack tensors, tokenise text
    f = enc.encode(modality, b)          # float32 [B, enc.dims[modality]] on enc's device

Encoders are frozen: built in eval mode, every parameter has requires_grad=False, and `.train()`
keeps them in eval mode. `fingerprint` is a short hex id of the architecture, preprocessing and weight
values; the feature store keys its tables with it, and with `precision` (fp32, or fp16 autocast with `amp`
on CUDA), which the fingerprint leaves out: the same weights serve features of either precision.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ushash.core.registry import Registry
from ushash.data.store import FP16_AUTOCAST, FP32

ENCODERS = Registry("encoder", "ushash/encoders")

# Constructor arguments that change where or how fast an encoder runs, not what it computes. `amp` on CUDA
# does change the features' low bits (fp16 autocast): the feature store keys them by `Encoder.precision`, and
# the fingerprint (what serving compares with an export's) stays the same on CPU and GPU.
RUNTIME_ARGS = ("device", "amp")


def autocast_precision(amp: bool, device: str | torch.device) -> str:
    """The precision an encoder with `amp` computes at on `device`: FP16_AUTOCAST with `amp` on CUDA (what
    `Encoder._autocast` runs under), else FP32. Its features differ from fp32 ones in the low bits, so a
    store extracted under autocast is another store than the fp32 one (they once shared a folder)."""
    return FP16_AUTOCAST if amp and torch.device(device).type == "cuda" else FP32


def register(name: str) -> Callable[[type["Encoder"]], type["Encoder"]]:
    """Class decorator: make an Encoder subclass buildable as `build_encoder({"name": name, ...})`."""

    def deco(cls: type[Encoder]) -> type[Encoder]:
        cls.name = name
        return ENCODERS.add(name, cls)

    return deco


def build_encoder(cfg: Mapping[str, Any]) -> "Encoder":
    """Build a registered encoder from `{"name": ..., **kwargs}` (a dict or an OmegaConf DictConfig)."""
    cfg = to_plain_dict(cfg)
    if "name" not in cfg:
        raise ValueError(f"encoder config has no 'name'; known encoders: {sorted(ENCODERS)}")
    name = cfg.pop("name")
    cls = ENCODERS.lookup(name)
    check_kwargs(cls, cfg, f"encoder {name!r}")
    return cls(**cfg)


def to_plain_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A plain, resolved copy of a config mapping (DictConfig included)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf comes with hydra
        pass
    return copy.deepcopy(dict(cfg))


def check_kwargs(cls: type, kwargs: Mapping[str, Any], where: str) -> None:
    """Raise TypeError naming every key of `kwargs` that `cls.__init__` does not accept."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"{where}: unknown argument(s) {unknown}; accepted: {accepted}")


def with_defaults(cls: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` completed with `cls.__init__`'s defaults (so fingerprints do not depend on spelling)."""
    bound = inspect.signature(cls.__init__).bind_partial(None, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "self"}


def audio_to_length(wave: np.ndarray, sr: int, seconds: float) -> np.ndarray:
    """Crop (keeping the start) or zero-pad a mono wave to exactly round(sr * seconds) samples."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"expected a mono waveform (1-D), got shape {wave.shape}")
    n = int(round(sr * seconds))
    if len(wave) >= n:
        return wave[:n]
    return np.pad(wave, (0, n - len(wave)))


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a collated batch (tensor, mapping or sequence of them) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and batch and not isinstance(batch[0], str):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def default_device(device: str | torch.device | None) -> torch.device:
    """`device`, or CUDA when available, else CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def weights_digest(module: nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of every tensor in `module.state_dict()`."""
    h = hashlib.sha256()
    for key, t in module.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # buffer protocol: no copy
    return h.hexdigest()


class Part(nn.Module):
    """One modality's encoder inside a composite encoder (see `Encoder.parts`)."""

    dim: int
    code_version: int = 0  # see Encoder.code_version

    def preprocess(self, raw: Any) -> Any:
        raise NotImplementedError

    def collate(self, items: list[Any]) -> Any:
        return torch.stack(items)

    def forward(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError


class Encoder(nn.Module):
    """Base class of every frozen encoder.

    Subclasses either fill `self.parts` (a ModuleDict of `Part`s keyed by modality) and let the base
    class dispatch to them, or override `_preprocess`, `_collate` and `_encode` (e.g. one CLIP model
    that serves two modalities; `MediaTextEncoder` does the first two for a media + text pair). Either way they end `__init__` with `self._finish(config)`.
    """

    name: str = ""
    #: raised with a change to what the code computes (preprocessing, pooling) that neither the config nor the
    #: weights show, so that the stores of the old features are not reused (as media.DECODE_VERSION does for
    #: decoding); a Part has its own. 0 everywhere leaves the fingerprints as they were before it existed.
    code_version: int = 0
    modalities: tuple[str, ...] = ()
    sample_rate: int | None = None  # Hz the audio input must have; None without audio
    audio_seconds: float | None = None  # clip length audio is cropped/padded to; None without audio

    def __init__(self, device: str | torch.device | None = None, amp: bool = True):
        super().__init__()
        self.parts = nn.ModuleDict()
        self.dims: dict[str, int] = {}
        self.amp = bool(amp)
        self._target_device = default_device(device)
        self.fingerprint = ""

    # -- construction ------------------------------------------------------------------------
    def _finish(self, config: Mapping[str, Any]) -> None:
        """Freeze, fill modalities/dims from `parts` if used, fingerprint on CPU, move to the device."""
        if len(self.parts):
            self.modalities = tuple(self.parts)
            self.dims = {m: int(p.dim) for m, p in self.parts.items()}
        if set(self.dims) != set(self.modalities):
            raise RuntimeError(f"{type(self).__name__}: dims {self.dims} do not match modalities {self.modalities}")
        self.requires_grad_(False)
        self.eval()
        arch = {k: v for k, v in config.items() if k not in RUNTIME_ARGS}
        record = {"name": self.name, "config": arch, "dims": self.dims, "weights": weights_digest(self)}
        code = {m: p.code_version for m, p in self.parts.items() if p.code_version}
        if self.code_version or code:
            record["code"] = {"encoder": self.code_version, **code}
        blob = json.dumps(record, sort_keys=True, default=str)
        self.fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
        self.to(self._target_device)

    def train(self, mode: bool = True) -> "Encoder":
        """Encoders stay in eval mode: BatchNorm statistics and dropout are part of the frozen model."""
        return super().train(False)

    @property
    def precision(self) -> str:
        """What `encode` computes at where the encoder is now (`autocast_precision`): part of a store's key."""
        return autocast_precision(self.amp, self.device)

    @property
    def device(self) -> torch.device:
        for t in self.parameters():
            return t.device
        for t in self.buffers():
            return t.device
        return self._target_device

    # -- the interface -----------------------------------------------------------------------
    def preprocess(self, modality: str, raw: Any) -> Any:
        """CPU, one item: PIL.Image (image), np.float32 mono wave at `sample_rate` (audio), str (text)."""
        self._check(modality)
        return self._preprocess(modality, raw)

    def collate(self, modality: str, items: list[Any]) -> Any:
        """CPU, one batch of `preprocess` outputs -> what `encode` takes."""
        self._check(modality)
        return self._collate(modality, list(items))

    def encode(self, modality: str, batch: Any) -> torch.Tensor:
        """float32 [B, dims[modality]] on this encoder's device; no autograd graph."""
        self._check(modality)
        batch = to_device(batch, self.device)
        with torch.inference_mode(), self._autocast():
            out = self._encode(modality, batch)
        return out.float()

    # -- hooks -------------------------------------------------------------------------------
    def text_tokens(self, text: str) -> tuple[int, int] | None:
        """(the tokens `text` has, the tokens the text tower reads) where its tokenizer counts them (the hashing
        and Hugging Face ones), else None. A text over the window is encoded by its first tokens alone."""
        tower = self.parts["text"] if "text" in self.parts else self
        tok = getattr(tower, "tokenizer", None)
        if not hasattr(tok, "n_tokens"):
            return None
        return tok.n_tokens(str(text)), int(tok.max_length)

    def tokenizer_digests(self) -> dict[str, str]:
        """{"text tokenizer": digest} where the text tower's tokenizer is read from files (a Hugging Face one:
        `tokenizing.tokenizer_digest`), which the fingerprint does not cover: a store records it beside the
        library versions, and one made with other tokenizer files is checked before it is reused. {} else."""
        if getattr(self, "_tokenizer_digests", None) is None:
            from ushash.encoders.tokenizing import tokenizer_digest

            tower = self.parts["text"] if "text" in self.parts else self
            digest = tokenizer_digest(getattr(tower, "tokenizer", None)) if "text" in self.modalities else None
            self._tokenizer_digests = {} if digest is None else {"text tokenizer": digest}
        return dict(self._tokenizer_digests)

    def _preprocess(self, modality: str, raw: Any) -> Any:
        return self.parts[modality].preprocess(raw)

    def _collate(self, modality: str, items: list[Any]) -> Any:
        return self.parts[modality].collate(items)

    def _encode(self, modality: str, batch: Any) -> torch.Tensor:
        return self.parts[modality](batch)

    # -- helpers -----------------------------------------------------------------------------
    def _check(self, modality: str) -> None:
        if modality not in self.modalities:
            raise ValueError(f"encoder {self.name!r} has no {modality!r} tower; it encodes {self.modalities}")

    def _autocast(self):
        """fp16 autocast on CUDA when `amp` is on; never on CPU (`precision` says which)."""
        if self.precision == FP16_AUTOCAST:
            return torch.autocast("cuda", dtype=torch.float16)
        return contextlib.nullcontext()

    def extra_repr(self) -> str:
        return f"name={self.name!r}, dims={self.dims}, fingerprint={self.fingerprint!r}"


class MediaTextEncoder(Encoder):
    """Base of the encoders with one media tower (image or audio) beside a text tower that `self.tokenizer`
    feeds (openclip, hf_clip, clap): text items stay strings until `_collate` tokenises the batch; media
    items are tensors from `_preprocess_media`, stacked per batch."""

    def _preprocess_media(self, raw: Any) -> torch.Tensor:
        raise NotImplementedError

    def _preprocess(self, modality: str, raw: Any) -> Any:
        if modality == "text":
            return str(raw)
        return self._preprocess_media(raw)

    def _collate(self, modality: str, items: list[Any]) -> Any:
        if modality == "text":
            return self.tokenizer(items)
        return torch.stack(items)


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block (e.g. random weight init) under a fixed CPU RNG seed, restoring the RNG after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
