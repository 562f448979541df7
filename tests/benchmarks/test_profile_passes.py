"""benchmarks/profile_passes.py: how it sorts kernels and reads the profiler's events, and its documented command."""

import json
import subprocess
import sys

import pytest
from benchmark_scripts import ENV, documented_commands, load_benchmark
from documents import ROOT
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent


profiler = load_benchmark("profile_passes")
# Kernel and operator names, as profiles on a GPU and a CPU give them, by the kind of work they do.
KINDS = {
    "GEMM": ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "nvjet_tst_192x192_64x4_2x1_v_bz_TNT",
             "triton_tem_fused_addmm_gelu_0", "aten::addmm", "aten::mm", "aten::bmm"],  # inductor's template, fused
    "attention": ["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>",
                  "aten::_scaled_dot_product_flash_attention_for_cpu"],
    "norm": ["triton_per_fused_add_native_layer_norm_transpose_3", "graph_0_cpp_fused_native_layer_norm_transpose_0",
             "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>"],
    "activation": ["triton_poi_fused_addmm_gelu_1", "aten::gelu_backward"],  # pointwise after the GEMM it names
    "layout": ["triton_poi_fused_clone_2", "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>",
               "aten::copy_", "aten::stack"],  # stack: the backward of unbind (U-ViT's q, k, v)
    "optimizer": ["void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>"],
    "other": ["void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "aten::add"],
}  # fmt: skip


def test_kernels_are_sorted_by_the_work_their_names_say():
    found = {name: profiler.kind_of(name) for names in KINDS.values() for name in names}
    assert found == {name: kind for kind, names in KINDS.items() for name in names}


def event(name: str, start: int, end: int, device_type=DeviceType.CPU, parent: FunctionEvent | None = None):
    made = FunctionEvent(start, name, 0, start, end, device_type=device_type, use_device="cuda")
    if parent is not None:
        made.cpu_parent = parent
        parent.append_cpu_child(made)
    return made


def test_on_a_gpu_each_kernel_counts_once_and_its_launching_operator_not_at_all():
    mm = event("aten::mm", 0, 50)
    mm.append_kernel("sm90_xmma_gemm", 0, 30)  # the operator carries its kernel's device time too
    spans = [("sm90_xmma_gemm", 10, 40), ("sm90_xmma_gemm", 60, 90), ("triton_per_fused_native_layer_norm_0", 90, 95)]
    kernels = [event(name, start, end, DeviceType.CUDA) for name, start, end in spans]
    times = profiler.kernel_times([mm, *kernels], "cuda")
    assert times == {"sm90_xmma_gemm": (60.0, 2, "GEMM"), "triton_per_fused_native_layer_norm_0": (5.0, 1, "norm")}


def test_on_the_cpu_operators_count_their_self_time_and_adamw_counts_as_the_optimizer():
    step = event("Optimizer.step#AdamW.step", 0, 100)
    inside = event("aten::addcdiv_", 10, 30, parent=event("aten::_foreach_step", 5, 40, parent=step))
    linear = event("aten::linear", 100, 200)  # a wrapper: its self time is dispatch, its addmm the work
    addmm = event("aten::addmm", 110, 190, parent=linear)
    times = profiler.kernel_times([step, inside.cpu_parent, inside, linear, addmm], "cpu")
    assert times["aten::addcdiv_ (in Optimizer.step)"] == (20.0, 1, "optimizer") and "aten::addcdiv_" not in times
    assert times["aten::addmm"] == (80.0, 1, "GEMM") and "aten::linear" not in times


@pytest.mark.slow
def test_the_documented_command_profiles_each_pass_and_counts_every_gemm(tmp_path):
    # docs/benchmarks.md's command, shrunk to depth 2, batch 1 and one profiled step, eager, every kernel listed.
    shrink = ["--models", "F2-deep", "--mode", "eager", "--num_layers", "2", "--batch_size", "1", "--steps", "1"]
    shrink += ["--top", "1000", "--output_dir", str(tmp_path)]
    command = [sys.executable, *documented_commands("profile_passes")[0][1:], *shrink]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "profile.md").read_text()
    assert "## Share of kernel time by kind" in report and "## F2-deep, training: the" in report
    profiles = {p["pass_"]: p for p in json.loads((tmp_path / "profile.json").read_text())["profiles"]}
    assert set(profiles) == {"sampling", "training"}
    for profile in profiles.values():
        assert sum(profile["shares"].values()) == pytest.approx(1.0) and 0 < profile["kernel_ms"] <= profile["step_ms"]
        assert profile["shares"]["GEMM"] > 0
    assert profiles["sampling"]["shares"]["optimizer"] == 0 < profiles["training"]["shares"]["optimizer"]
    # Every matrix multiply is profiled: as many mm/addmm/bmm calls as speed_vs_uvit.meta_pass traces for the pass.
    speed = sys.modules[profiler.build.__module__]
    for pass_, rows in (("sampling", 2), ("training", 1)):
        calls = sum(c for name, _, _, c in profiles[pass_]["top"] if name in ("aten::mm", "aten::addmm", "aten::bmm"))
        _, operands = speed.meta_pass("F2-deep", 2, rows, train=pass_ == "training")
        assert calls == len(operands) > 0
