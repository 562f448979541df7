"""benchmarks/roofline.py: its kernel charges, its FLOPs (the speed benchmark's), and the docs print what it prints."""

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from benchmark_scripts import documented_commands, load_benchmark
from documents import section, text


BF16, BOUNDS = 2, ("unfused", "fused")  # bytes per element; the estimate's two bounds
roofline, speed = load_benchmark("roofline"), load_benchmark("speed_vs_uvit")


def meta(*shape: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=torch.bfloat16, requires_grad=requires_grad)


def test_a_linear_reads_and_writes_once_views_are_free_and_a_copy_or_a_broadcast_add_moves_its_bytes():
    linear, x, bias = (meta(6, 10), meta(4, 10), meta(4)), meta(3, 5, 7), meta(7)
    with roofline.recording() as recorder:
        F.linear(*linear)  # addmm(bias, x, weight.T): the transpose is a view
        x.transpose(1, 2).reshape(3, 35)  # a view, then not viewable: one copy, then a free reshape of the copy
        x + bias  # the bias is read once, not once per row
    assert [(op.name, op.kind, op.flops, op.bytes) for op in recorder.ops] == [
        ("addmm", "GEMM", 2 * 6 * 4 * 10, BF16 * (60 + 40 + 4 + 24)),
        ("clone", "layout", 0, BF16 * 2 * 3 * 5 * 7), ("add", "other", 0, BF16 * (2 * 3 * 5 * 7 + 7)),
    ]  # fmt: skip


def test_a_layer_norm_over_a_strided_view_first_copies_it():
    tokens = meta(2, 6, 4)  # (B, L, D)
    with roofline.recording() as recorder:
        F.layer_norm(tokens.transpose(1, 2), (6,))  # over the token axis, as the left hemisphere's norm
    assert [(op.name, op.kind) for op in recorder.ops] == [
        ("native_layer_norm (copy of a strided input)", "layout"), ("native_layer_norm", "norm")
    ]  # fmt: skip
    assert recorder.ops[0].bytes == 2 * BF16 * 2 * 6 * 4  # read and written once
    with roofline.recording() as recorder:
        F.layer_norm(tokens, (4,))
    assert [op.name for op in recorder.ops] == ["native_layer_norm"]
    gradient = meta(2, 1, 1).expand(2, 4, 6)  # broadcast: 2 elements
    with roofline.recording() as recorder:
        torch.ops.aten.native_layer_norm_backward(
            gradient, tokens.transpose(1, 2), (6,), meta(2, 4, 1), meta(2, 4, 1), meta(6), meta(6), [True, True, True]
        )
    copies = [op.bytes for op in recorder.ops if op.kind == "layout"]
    assert copies == [BF16 * (2 + 2 * 4 * 6), 2 * BF16 * 2 * 6 * 4]  # dY written whole, then X


def test_attention_is_one_flash_kernel_each_way():
    b, h, length, d = 2, 3, 11, 8
    query, key, value = (meta(b, h, length, d, requires_grad=True) for _ in range(3))
    with roofline.recording() as recorder:  # the defaults, written out, are plain attention
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        out.backward(torch.empty_like(out))
    assert out.shape == (b, h, length, d) and all(x.grad.shape == x.shape for x in (query, key, value))
    # no L × L scores, softmax or bmm: only the two fused kernels, and the backward's incoming gradient
    assert [op.name for op in recorder.ops] == ["flash_attention", "flash_attention_backward"]
    forward, backward = recorder.ops
    # QKᵀ and PV; QKᵀ again, then dV, dP, dQ, dK. Q, K, V and O read or written; and dO, dQ, dK, dV.
    matmul, tensor = 2 * b * h * length * length * d, BF16 * b * h * length * d
    flops, moved = (forward.flops, backward.flops), (forward.bytes, backward.bytes)
    assert flops == (2 * matmul, 5 * matmul) and moved == (4 * tensor, 8 * tensor)


@pytest.mark.parametrize("option", ["is_causal", "attn_mask"])
def test_attention_it_cannot_model_is_refused(option):
    query = meta(1, 2, 5, 4)
    value = True if option == "is_causal" else torch.ones(5, 5, device="meta", dtype=torch.bool)
    with roofline.recording(), pytest.raises(NotImplementedError, match=rf"plain attention only, not \['{option}'\]"):
        F.scaled_dot_product_attention(query, query, query, **{option: value})


@pytest.mark.parametrize("name", ["U-ViT-S/2", "F2-deep", "4E2H"])
@pytest.mark.parametrize("pass_", ["sampling", "training"])
def test_the_flops_are_the_speed_benchmarks_counts(name, pass_):
    ops, rows = roofline.trace(name, 2, pass_, num_layers=2), 4 if pass_ == "sampling" else 2  # [uncond | cond]
    counted, _ = speed.meta_pass(name, 2, rows, train=pass_ == "training")
    recomputed = 0  # FlashAttention's backward recomputes QKᵀ, which the decomposed attention keeps
    if name == "U-ViT-S/2" and pass_ == "training":
        config = speed.build(name, 2, device="meta").config
        length = 1 + config.text_seq_len + (config.sample_size // config.patch_size) ** 2
        recomputed = 3 * 2 * rows * length**2 * config.hidden_size  # 3 blocks; H · (D/H) = D
    assert sum(op.flops for op in ops) == counted + recomputed and all(op.bytes > 0 for op in ops)


def test_a_kernel_takes_its_compute_or_its_memory_time_whichever_is_longer_and_the_bounds_add_up():
    h100, square = roofline.GPUS["H100"], roofline.Op("mm", "GEMM", flops=2 * 4096**3, bytes=BF16 * 3 * 4096**2)
    assert square.seconds(h100) == pytest.approx(2 * 4096**3 / 989e12)  # compute-bound
    assert roofline.Op("add", "other", flops=0, bytes=3 * 10**9).seconds(h100) == pytest.approx(3e9 / 3350e9)
    ops = roofline.trace("F2-deep", 2, "training", num_layers=2)
    row = roofline.estimate("F2-deep", "training", 2, "H100", ops)
    assert row.kernels == len(ops) and sum(row.ms_by_kind.values()) == pytest.approx(row.unfused_ms)
    assert row.fused_ms == pytest.approx(row.ms_by_kind["GEMM"] + row.ms_by_kind["attention"])
    assert 0 < row.fused_ms < row.unfused_ms and row.gigabytes == pytest.approx(sum(op.bytes for op in ops) / 1e9)


@pytest.mark.slow
def test_the_pages_print_the_scripts_estimate(tmp_path, capsys):
    # The command writes what it prints; docs/speed-gpu.md's tables are that, line for line, the README's its rows.
    rows = roofline.main([*documented_commands("roofline")[0][2:], "--output_dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "An estimate, not a measurement" in printed and (tmp_path / "roofline.md").read_text() == printed
    saved = {(r["model"], r["pass_"], r["gpu"]) for r in json.loads((tmp_path / "roofline.json").read_text())}
    models = ("U-ViT-S/2", "F2-deep", "4E2H")
    assert saved == {(m, p, gpu) for m in models for p in roofline.PASSES for gpu in roofline.GPUS}
    assert all(roofline.speedup(r, rows, b) == 1.0 for r in rows if r.model == "U-ViT-S/2" for b in BOUNDS)
    page = section("docs/speed-gpu.md", "A roofline estimate")
    table_lines = [line for line in printed.splitlines() if line.startswith("| ")]
    assert table_lines and all(line in page.splitlines() for line in table_lines)
    readme = section("README.md", "Speed")
    for gpu, pass_ in itertools.product(roofline.GPUS, roofline.PASSES):
        at = {r.model: r for r in rows if (r.pass_, r.gpu, r.batch_size) == (pass_, gpu, 256)}
        uvit, f2 = at["U-ViT-S/2"], at["F2-deep"]
        line = (
            f"| {gpu} | {pass_} | {uvit.unfused_ms:.1f} / {f2.unfused_ms:.1f} | "
            f"{roofline.speedup(f2, rows, 'unfused'):.2f}× | {uvit.fused_ms:.1f} / {f2.fused_ms:.1f} | "
            f"{roofline.speedup(f2, rows, 'fused'):.2f}× |"
        )
        assert line in readme.splitlines(), line
    assert "estimate" in readme.lower() and text("README.md").count("python benchmarks/roofline.py") == 1
