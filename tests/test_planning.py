"""plan_model_variants: several option sets from one trace plan exactly what plan_model plans."""
import pytest

from lynx_compile.models import build_model, example_batch
from lynx_compile.planning import plan_model, plan_model_variants

COMMON = dict(cost_source="analytic", hardware="h100-sxm", plan_cache=False)


def test_variants_plan_what_separate_traces_plan():
    """Under Inductor (the default; tests/test_baseline_reach_tp.py plans variants under eager)."""
    compiler = "inductor"
    model = build_model("gpt-tiny", dropout=0.0)
    x = example_batch(model, 2)
    variants = [{"policy": "full"}, {"policy": "lynx", "memory_budget": 0.9, "solver": "heu"}]
    together = plan_model_variants(model, (x,), variants, compiler=compiler, **COMMON)
    for variant, records in zip(variants, together):
        (mine,), (alone,) = records, plan_model(model, (x,), compiler=compiler, **variant, **COMMON)
        a, b = mine.plan, alone.plan
        assert (a.policy, a.graph_hash, a.peak_bytes, a.exposed_s) == (b.policy, b.graph_hash, b.peak_bytes, b.exposed_s)
        assert [d.name for d in a.saved] == [d.name for d in b.saved]


def test_variants_must_share_a_compiler():
    model = build_model("gpt-tiny")
    with pytest.raises(ValueError, match="share a compiler"):
        plan_model_variants(model, (example_batch(model, 1),), [{"compiler": "eager"}, {"compiler": "inductor"}])
