"""Public surface: entry point, bound backends, plans as JSON, packaging, CLI."""
import os
import importlib
import importlib.metadata
import json
import subprocess
import sys

import pytest
import torch

import lynx_compile
from lynx_compile.recompute_plan import RecomputePlan
from lynx_compile.tools.cli import main


def test_entry_point_registers_lynx():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "lynx" and ep.value == "lynx_compile.compiler.dynamo_backend:lynx_backend" for ep in eps)
    assert "lynx" in torch._dynamo.list_backends()


def test_console_script_is_the_tools_cli():
    eps = importlib.metadata.entry_points(group="console_scripts")
    assert any(ep.name == "lynx" and ep.value == "lynx_compile.tools.cli:main" for ep in eps)


@pytest.mark.parametrize("module, usage", [
    ("lynx_compile.train", "usage: lynx train"),
    ("lynx_compile.torchtitan_train", "usage: python -m lynx_compile.torchtitan_train"),
])
def test_kept_module_entries_run_their_tools_main(tmp_path, module, usage):
    """``python -m lynx_compile.train`` (what torchrun launches) and ``.torchtitan_train`` run
    their ``lynx_compile.tools`` module's main, and define nothing to import."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith(usage), out.stderr
    assert [n for n in vars(importlib.import_module(module)) if not n.startswith("__")] == []


def test_backend_binds_options_and_is_shared():
    a = lynx_compile.backend(policy="full")
    assert a.config.policy == "full"
    assert lynx_compile.backend(policy="full") is a
    assert lynx_compile.backend(policy="none") is not a


def test_no_top_level_passes_or_kernels_leak(tmp_path):
    """The install maps the repository's ``passes/`` and ``kernels/`` to ``lynx_compile.*`` only:
    no top-level ``passes`` or ``kernels`` of ours (Hugging Face's own ``kernels`` package, a
    dependency of transformers >= 5, may be installed and is not ours)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import importlib.util as u, os, sys, lynx_compile.passes, lynx_compile.kernels\n"
            "ours = lambda s: s is not None and os.path.abspath(s.origin or '').startswith(sys.argv[1] + os.sep)\n"
            "print(not ours(u.find_spec('passes')) and not ours(u.find_spec('kernels')))")
    out = subprocess.run([sys.executable, "-c", code, root], cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr


def test_plan_roundtrips_through_json(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--policy", "full", "--out", str(out)]) == 0
    plans = [RecomputePlan.from_dict(d) for d in json.loads(out.read_text())]
    assert plans and plans[0].policy == "full"
    assert RecomputePlan.from_json(plans[0].to_json()) == plans[0]
    assert len(plans[0].blocks) == 2 and all(b.recomputed for b in plans[0].blocks)


def test_cli_plan_prints_blocks(capsys):
    assert main(["plan", "--model", "llama-tiny", "--policy", "selective", "-v"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0" in out and "blocks.1" in out
    assert "peak activation memory" in out and "recomputes" in out


def test_cli_plan_meta_device_for_paper_scale(capsys):
    assert main(["plan", "--model", "gpt-1.3b", "--policy", "full", "--seq-len", "256",
                 "--batch-size", "1", "--hardware", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "blocks.23" in out and "hardware=h100-sxm" in out


def test_cli_bad_input_is_one_line_exit_2(capsys):
    assert main(["plan", "--model", "gpt-nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "gpt-small" in err  # names the valid presets
    with pytest.raises(SystemExit):
        main(["plan", "--policy", "fastest"])


def test_dump_dir_writes_graphs_before_and_after_each_pass(tmp_path):
    from lynx_compile.models import build_model, example_batch

    model = build_model("gpt-tiny")
    backend = lynx_compile.backend(policy="full", dump_dir=str(tmp_path), disable_passes=("annotate_costs_pass",),
                                   compiler="eager")
    torch.compile(model, backend=backend)(example_batch(model, 2)).loss.backward()
    folder = tmp_path / f"graph_{backend.records[-1].graph_id}"
    names = sorted(p.name for p in folder.iterdir())
    assert "joint_01_find_blocks_pass_after.txt" in names
    assert "apply_00_apply_decisions_pass_after.txt" in names
    assert "backward_00_mark_recomputed_pass_after.txt" in names
    assert "_recomputed" in (folder / "backward_00_mark_recomputed_pass_after.txt").read_text()
    assert any(t.skipped and t.name == "annotate_costs_pass" for t in backend.records[-1].timings)
