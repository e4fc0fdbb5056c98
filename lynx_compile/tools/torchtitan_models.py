"""torchtitan 0.3.0's ``debugmodel`` of each model package, as lynx builds it outside torchtitan's
trainer: SDPA attention in every layer, built on the meta device, then ``to_empty`` and torchtitan's
``init_weights``; fixed random tokens; torchtitan's ``CompileConfig`` for a backend.

Shared by ``tools/torchtitan_train.py`` (the distributed step) and ``benchmarks/torchtitan_models.py``
(one process), so both build the same model."""
from __future__ import annotations

import importlib
from typing import Any

import torch

MODELS = {"tt-llama3": "llama3", "tt-qwen3": "qwen3", "tt-deepseek": "deepseek_v3"}
"""lynx's names of torchtitan's model packages (``torchtitan.models.<package>``)."""
VOCAB = 2048  # every debugmodel's vocabulary


def available() -> str | None:
    """None when torchtitan's models and apply_compile import, else why not (one line)."""
    try:
        import torchtitan.distributed.compile  # noqa: F401
        for pkg in MODELS.values():
            importlib.import_module(f"torchtitan.models.{pkg}")
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
        return f"torchtitan cannot be imported ({type(exc).__name__}: {exc}); pip install -e '.[torchtitan]'"
    return None


def model_spec(name: str) -> Any:
    """The ``ModelSpec`` of torchtitan's ``debugmodel`` of ``name`` (a key or value of MODELS)."""
    pkg = importlib.import_module(f"torchtitan.models.{MODELS.get(name, name)}")
    return pkg.model_registry("debugmodel")


def model_config(name: str, *, layers: int | None = None) -> Any:
    """The registry's ``debugmodel`` config of ``name`` with SDPA attention in every layer
    (FlexAttention, the registry's, has no CPU backward and ``apply_compile`` refuses any backend
    but inductor / aot_eager with it), exactly as torchtitan's graph_trainer tests do
    (``experiments/graph_trainer/common_utils.build_decoder_config_for_backend``; causal, no
    per-document mask). ``layers``: keep only the first ``layers`` blocks."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = model_spec(name).model
    if layers is not None:
        config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def materialize(model: Any, device: torch.device | str = "cpu") -> Any:
    """``to_empty`` and torchtitan's ``init_weights``, as ``Trainer.__init__`` does after
    parallelizing; train mode."""
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def build(name: str, *, seed: int = 0, layers: int | None = None) -> Any:
    """torchtitan's ``debugmodel`` of ``name`` (:func:`model_config`), float32, on the CPU, one
    process: built on the meta device, initialized under ``torch.manual_seed(seed)``."""
    config = model_config(name, layers=layers)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    return materialize(model)


def batch(batch_size: int, seq: int, *, seed: int = 1) -> tuple[Any, Any]:
    """Token ids and next-token labels, ``(batch_size, seq)`` each."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def compile_config(backend: Any) -> Any:
    """torchtitan's ``CompileConfig`` with ``backend`` (a name or a backend object; None or
    ``"eager"``: compile off): model and loss compiled (its default ``components``)."""
    from torchtitan.config import CompileConfig

    if backend is None or backend == "eager":
        return CompileConfig(enable=False)
    return CompileConfig(enable=True, backend=backend)
