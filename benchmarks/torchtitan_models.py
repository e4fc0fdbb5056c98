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

from typing import Any, Callable

# The model, its batch and torchtitan's CompileConfig are the launcher's
# (``python -m lynx_compile.torchtitan_train``: lynx_compile/tools/torchtitan_models.py), shared so
# both build the same model.
from lynx_compile.tools.torchtitan_models import MODELS, VOCAB, available, batch, build, compile_config  # noqa: F401


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


def step_fn(name: str, style: str, backend: Any, batch_size: int, seq: int,
            layers: int | None = None) -> tuple[Any, Callable[[], Any]]:
    """(model, step): ``step()`` runs one forward, torchtitan's loss and backward, both compiled
    with ``backend`` (None: eager), and returns the loss. ``layers``: only the registry's first
    ``layers`` blocks (None: all)."""
    model = build(name, layers=layers)
    fn = compiled(model, style, backend)
    loss_of = loss(backend)
    tokens, labels = batch(batch_size, seq)

    def step() -> Any:
        out = loss_of(fn(tokens), labels)
        out.backward()
        return out

    return model, step
