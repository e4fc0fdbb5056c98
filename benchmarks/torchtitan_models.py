"""torchtitan 0.3.0's debug models on CPU, built and compiled the way torchtitan does it.

Used by ``benchmarks/bench_budget.py`` (models ``tt-llama3``, ``tt-qwen3``, ``tt-deepseek``) and
``tests/test_torchtitan.py``. Install: ``pip install -e ".[torchtitan]"`` pins torchtitan and the
few packages its model, config and compile code import; ``make install-torchtitan`` installs
them with ``--no-deps`` so pip never resolves torch.

- **Models**: ``debugmodel`` from each model package's own registry
  (``torchtitan.models.<m>.model_registry("debugmodel")``): llama3 (6 layers, dim 256, 16 heads,
  ComplexRoPE, vocabulary 2048), qwen3 (8 layers, dim 256, head dim 128, GQA 16/8, q/k norm,
  tied embedding), deepseek_v3 (6 layers: 1 dense + 5 MoE with 8 routed experts top-3 and 2
  shared, MLA attention with kv_lora_rank 512). Nothing of the architecture is changed but the
  attention core: the language models' registries build FlexAttention (no CPU backward), so
  each layer's ``attention.inner_attention`` becomes ``ScaledDotProductAttention.Config()``,
  exactly as torchtitan's own graph_trainer tests do
  (``experiments/graph_trainer/common_utils.build_decoder_config_for_backend``; SDPA is causal,
  with no per-document mask). Built on the meta device, ``to_empty`` on the CPU and
  ``init_weights`` as ``torchtitan.trainer.Trainer`` does; float32, train mode.
- **Loss**: torchtitan's ``components.loss.CrossEntropyLoss`` (summed cross-entropy, divided by
  the number of tokens as ``Trainer.forward_backward_step`` does), compiled with the same backend
  by torchtitan itself (``CompileConfig.components`` defaults to model *and* loss): a graph of
  its own, after the model's.
- **Per-block compile**: ``torchtitan.distributed.compile.apply_compile`` itself, with a
  ``CompileConfig`` whose ``backend`` is the backend object (``"inductor"`` or
  ``lynx_compile.backend(memory_budget=...)``): it calls ``block.compile(backend=backend,
  fullgraph=True)`` on every ``model.layers`` child. It refuses backends other than
  ``inductor`` / ``aot_eager`` only for models holding FlexAttention modules, which these (SDPA)
  do not. It also sets ``torch._dynamo.config.capture_scalar_outputs = True`` and
  ``skip_fwd_side_effects_in_bwd_under_checkpoint = True`` (process-wide, as in torchtitan).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

MODELS = {"tt-llama3": "llama3", "tt-qwen3": "qwen3", "tt-deepseek": "deepseek_v3"}
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


def build(name: str, *, seed: int = 0, layers: int | None = None) -> Any:
    """torchtitan's ``debugmodel`` of ``name`` (a key of MODELS), SDPA attention, float32, on
    the CPU, initialized by torchtitan's ``init_weights`` under ``torch.manual_seed(seed)``.
    ``layers``: keep only the registry's first ``layers`` blocks (a quicker compile)."""
    import torch
    from torchtitan.models.common.attention import ScaledDotProductAttention

    pkg = importlib.import_module(f"torchtitan.models.{MODELS[name]}")
    config = pkg.model_registry("debugmodel").model
    if layers is not None:
        config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model.train()


def batch(batch_size: int, seq: int, *, seed: int = 1) -> tuple[Any, Any]:
    """Token ids and next-token labels, ``(batch_size, seq)`` each."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def compile_config(backend: Any) -> Any:
    """torchtitan's ``CompileConfig`` with ``backend`` (a name or a backend object): model and
    loss compiled (its default ``components``)."""
    from torchtitan.config import CompileConfig

    return CompileConfig(enable=True, backend=backend)


def loss(backend: Any = None) -> Callable[[Any, Any], Any]:
    """torchtitan's ``CrossEntropyLoss`` (summed cross-entropy / the number of tokens, as
    ``Trainer.forward_backward_step`` calls it), compiled with ``backend`` by torchtitan's own
    ``BaseLoss._maybe_compile`` as the trainer does with ``compile.components`` = model, loss
    (``backend`` None: eager). ``loss(backend)(logits, labels)`` -> scalar."""
    from torchtitan.components.loss import CrossEntropyLoss

    fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build(
        compile_config=None if backend is None else compile_config(backend))
    return lambda pred, labels: fn(pred, labels, labels.numel())[0]


def apply_compile(model: Any, backend: Any) -> None:
    """torchtitan's per-block compile (``torchtitan.distributed.compile.apply_compile``) with
    ``backend`` (a name or a backend object), one process, no parallelism."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile as tt_apply_compile

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    tt_apply_compile(model, compile_config=compile_config(backend), parallel_dims=dims)


def compiled(model: Any, style: str, backend: Any) -> Callable:
    """The model's callable: ``per-block`` = ``apply_compile``; ``whole`` =
    ``torch.compile(model, backend=backend)``; ``backend`` None: eager."""
    import torch

    if backend is None:
        return model
    if style == "per-block":
        apply_compile(model, backend)
        return model
    if style == "whole":
        return torch.compile(model, backend=backend)
    raise ValueError(f"style {style!r}: per-block or whole")


def step_fn(name: str, style: str, backend: Any, batch_size: int, seq: int) -> tuple[Any, Callable[[], Any]]:
    """(model, step): ``step()`` runs one forward, torchtitan's loss and backward, both compiled
    with ``backend`` (None: eager), and returns the loss."""
    model = build(name)
    fn = compiled(model, style, backend)
    loss_of = loss(backend)
    tokens, labels = batch(batch_size, seq)

    def step() -> Any:
        out = loss_of(fn(tokens), labels)
        out.backward()
        return out

    return model, step
