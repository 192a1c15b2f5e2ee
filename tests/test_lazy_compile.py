"""megatron-core imports without TorchInductor; its decorated functions still compile on use."""

import os
import subprocess
import sys

import torch

from megatron_rl.util.lazy_compile import deferred, deferred_torch_compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_megatron_core_imports_without_inductor_and_torch_compile_is_restored():
    code = ("import sys, torch, megatron_rl\n"
            "real = torch.compile\n"
            "import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.jit as jit\n"
            "assert torch.compile is real, 'torch.compile not restored'\n"
            "assert 'torch._inductor.compile_fx' not in sys.modules, 'inductor imported'\n"
            "assert jit.jit_fuser.__name__ == 'compile_later', jit.jit_fuser\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.stdout.strip() == "ok", res.stderr[-3000:]


def test_deferred_compile_calls_the_real_one_once_on_first_use():
    calls = []

    def fake_compile(fn=None, **kwargs):
        calls.append(kwargs)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    lazy = deferred(fake_compile)

    @lazy(mode="max-autotune")
    def add(a, b):
        return a + b

    plain = lazy(lambda x: 2 * x, dynamic=True)
    assert calls == [] and add.__name__ == "add"
    assert add(1, 2) == ("compiled", 3) and add(2, 2) == ("compiled", 4)
    assert plain(3) == ("compiled", 6)
    assert calls == [{"mode": "max-autotune"}, {"dynamic": True}]
    lazy(torch.nn.Linear(2, 2), fullgraph=True)  # a module is compiled at once
    assert calls[-1] == {"fullgraph": True} and len(calls) == 3


def test_deferred_torch_compile_restores_the_real_function():
    real = torch.compile
    with deferred_torch_compile():
        assert torch.compile is not real
    assert torch.compile is real


def test_loading_a_config_imports_no_megatron_core(tmp_path):
    """The launcher loads and checks the config before it spawns the ranks: it must stay light
    (and quiet: megatron-core warns on import without TE/apex, before any config error). Up to
    the spawn (input checks, resume preflight, rank environment) it imports no torch at all: each
    rank imports its own."""
    code = ("import sys\n"
            "from megatron_rl.config.load import load_config\n"
            f"cfg = load_config('examples/tiny_dapo.yaml', ['output_dir={tmp_path}'])\n"
            "bad = [m for m in ('megatron.core', 'reasoning_gym', 'torch.distributed.checkpoint')"
            " if m in sys.modules]\n"
            "from megatron_rl.cli.app import build_parser, local_spawn_env\n"
            "from megatron_rl.run.guard import preflight\n"
            "from megatron_rl.run.input_checks import check_inputs\n"
            "build_parser(); check_inputs(cfg); preflight(cfg); local_spawn_env('auto', 1)\n"
            "bad += [m for m in ('torch', 'megatron.core') if m in sys.modules]\n"
            "print('heavy:', bad)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert res.stdout.strip() == "heavy: []", res.stdout + res.stderr[-3000:]
