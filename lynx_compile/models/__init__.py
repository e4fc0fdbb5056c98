"""Model zoo: GPT-2 style and Llama-style decoders sized from tiny (tests) to 23B (planning).

    >>> from lynx_compile.models import build_model, example_batch
    >>> model = build_model("gpt-tiny", dropout=0.0)
    >>> model(example_batch(model, 2)).loss.backward()

Every model has ``model.blocks`` (an ``nn.ModuleList`` of identical ``(B, T, C) -> (B, T, C)``
blocks, each with ``attn`` and ``mlp`` children) and returns :class:`LMOutput` from
``forward(idx, targets=None)``. See ``common.py`` for why attention defaults to the manual form.
"""
from lynx_compile.models.common import LMOutput
from lynx_compile.models.gpt import GPT, GPTConfig
from lynx_compile.models.llama import Llama, LlamaConfig
from lynx_compile.models.presets import (
    PRESETS,
    ModelConfig,
    build_model,
    example_batch,
    get_config,
    load_model_spec,
    num_parameters,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "LMOutput",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "PRESETS",
    "build_model",
    "example_batch",
    "get_config",
    "load_model_spec",
    "num_parameters",
]
