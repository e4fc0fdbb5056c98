"""Named model configurations and the helpers that build models from names.

Parameter counts (``num_parameters``; GPT counts the tied LM head once; checked by
``tests/test_models.py`` against this table and against a meta-device build):

    =============  ======  ======  =====  =====  ======  ======  ================
    preset         layers  hidden  heads  kv     seq     vocab   parameters
    =============  ======  ======  =====  =====  ======  ======  ================
    gpt-tiny       2       64      4      -      32      128     110,336
    gpt-small      4       128     4      -      128     512     875,264
    gpt-medium     8       256     8      -      256     1024    6,646,272
    llama-tiny     2       64      4      2      32      128     139,584
    llama-small    4       128     4      2      128     512     1,115,264
    llama-medium   8       256     8      4      256     1024    6,820,096
    gpt-1.3b       24      2048    16     -      2048    51200   1,317,654,528
    gpt-2.7b       32      2560    32     -      2048    51200   2,653,967,360
    gpt-6.7b       32      4096    32     -      2048    51200   6,662,266,880
    gpt-13b        40      5120    40     -      2048    51200   12,858,214,400
    gpt-23b        50      6144    48     -      2048    51200   22,980,403,200
    =============  ======  ======  =====  =====  ======  ======  ================

The paper-scale GPT presets follow GPT-3 (arXiv 2005.14165, table 2.1) with the 51200-token
vocabulary of Megatron-LM, except that gpt-13b is 5120 wide (GPT-3: 5140) for 128-wide heads;
gpt-23b is ours (GPT-3 has no 23B model): 50 layers of width 6144. The Llama presets size the
SwiGLU by the Llama rule (``LlamaConfig.ffn_dim``).
Build them with ``device="meta"`` to plan without allocating.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch
from torch import Tensor, nn

from lynx_compile.models.gpt import GPT, GPTConfig
from lynx_compile.models.llama import Llama, LlamaConfig

ModelConfig = GPTConfig | LlamaConfig

_PAPER = dict(seq_len=2048, vocab_size=51200)

PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=128, seq_len=32, n_layers=2, hidden=64, n_heads=4),
    "gpt-small": GPTConfig(vocab_size=512, seq_len=128, n_layers=4, hidden=128, n_heads=4),
    "gpt-medium": GPTConfig(vocab_size=1024, seq_len=256, n_layers=8, hidden=256, n_heads=8),
    "llama-tiny": LlamaConfig(
        vocab_size=128, seq_len=32, n_layers=2, hidden=64, n_heads=4, n_kv_heads=2
    ),
    "llama-small": LlamaConfig(
        vocab_size=512, seq_len=128, n_layers=4, hidden=128, n_heads=4, n_kv_heads=2
    ),
    "llama-medium": LlamaConfig(
        vocab_size=1024, seq_len=256, n_layers=8, hidden=256, n_heads=8, n_kv_heads=4
    ),
    "gpt-1.3b": GPTConfig(n_layers=24, hidden=2048, n_heads=16, **_PAPER),
    "gpt-2.7b": GPTConfig(n_layers=32, hidden=2560, n_heads=32, **_PAPER),
    "gpt-6.7b": GPTConfig(n_layers=32, hidden=4096, n_heads=32, **_PAPER),
    "gpt-13b": GPTConfig(n_layers=40, hidden=5120, n_heads=40, **_PAPER),
    "gpt-23b": GPTConfig(n_layers=50, hidden=6144, n_heads=48, **_PAPER),
}


def get_config(name_or_config: str | ModelConfig, **overrides: Any) -> ModelConfig:
    """The config for a preset name (or the config itself), with ``overrides`` replacing fields.

    Raises ValueError naming the valid presets when the name is unknown.
    """
    if isinstance(name_or_config, str):
        if name_or_config not in PRESETS:
            raise ValueError(
                f"unknown model preset {name_or_config!r}; valid presets: {', '.join(PRESETS)}"
            )
        config = PRESETS[name_or_config]
    elif isinstance(name_or_config, (GPTConfig, LlamaConfig)):
        config = name_or_config
    else:
        raise TypeError(f"expected a preset name or a model config, got {type(name_or_config)}")
    return dataclasses.replace(config, **overrides) if overrides else config


def num_parameters(config: str | ModelConfig) -> int:
    """Exact parameter count of the model ``config`` builds (tied weights once); no allocation."""
    return get_config(config).num_parameters()


def build_model(
    name_or_config: str | ModelConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> nn.Module:
    """Build a zoo model from a preset name or config: ``build_model("gpt-tiny", dropout=0.0)``.

    ``overrides`` replace config fields (``dataclasses.replace``). Parameters are created
    directly on ``device``; ``device="meta"`` allocates no storage, for planning paper-scale
    models. Weights are initialized in fp32 and then cast to ``dtype``, so the values (up to
    rounding) depend only on ``torch.manual_seed``, not on the dtype.
    """
    config = get_config(name_or_config, **overrides)
    cls = GPT if isinstance(config, GPTConfig) else Llama
    with torch.device(device):
        model = cls(config)
    return model.to(dtype=dtype)


def example_batch(
    model_or_config: nn.Module | str | ModelConfig,
    batch_size: int,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Random token ids of shape (batch_size, seq_len), int64, uniform over the vocabulary."""
    config = getattr(model_or_config, "config", model_or_config)
    config = get_config(config)
    shape = (batch_size, config.seq_len)
    return torch.randint(0, config.vocab_size, shape, generator=generator, device=device)


def load_model_spec(spec: str, **overrides: Any) -> nn.Module:
    """A model from a preset name (``"gpt-tiny"``) or a ``"module.path:callable"`` spec.

    The callable is called with ``overrides`` as keyword arguments and must return an
    ``nn.Module`` or a zoo config (which is then built). Preset names get ``overrides`` as
    config fields (see :func:`build_model`). Raises ValueError, listing the presets, for a spec
    that is neither.
    """
    if spec in PRESETS:
        return build_model(spec, **overrides)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown model {spec!r}: expected a preset ({', '.join(PRESETS)}) "
            "or 'module.path:callable'"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load model spec {spec!r}: {err}") from err
    result = factory(**overrides)
    if isinstance(result, (GPTConfig, LlamaConfig)):
        return build_model(result)
    if not isinstance(result, nn.Module):
        raise ValueError(f"{spec} returned {type(result).__name__}, expected an nn.Module")
    return result
