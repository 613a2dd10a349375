"""The recipe's precisions: quantiser bits against the OCP MX and NVFP4 definitions, every
precision trains repeatably, the stream header names the GEMM path, and FP8 delayed scaling
resumes exactly only when its amax history is checkpointed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import samebits
from samebits.checkpoint import CENSUS_DIR
from samebits.compare import diff
from samebits.errors import ConfigError
from samebits.recipes import RecipeConfig, train
from samebits.recipes import precision as P
from samebits.stream import open_run

needs_torchao = pytest.mark.skipif(not P.torchao_available(),
                                   reason=f"needs torchao ({P.TORCHAO_PIN}); .ci/run installs it")


def _tiny(**changes) -> RecipeConfig:
    return dataclasses.replace(RecipeConfig(num_layers=2, seq_len=32, micro_batch_size=2, vocab_size=256),
                               **changes)


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


# --- quantisers against the specs, on hand-checked values ----------------------------------

@needs_torchao
def test_mxfp8_bits_follow_the_ocp_mx_spec():
    # OCP MX v1.0 (section 6.3): one shared scale X = 2^(floor(log2(amax)) - emax) per 32
    # elements, emax = 8 for E4M3 (largest normal 448 = 1.75 * 2^8); X is stored as E8M0
    # (unsigned exponent, bias 127); each element is v / X rounded to E4M3 (bias 7), values
    # past 448 clamped to 448.
    x = torch.zeros(1, 96)
    x[0, :4] = torch.tensor([448.0, 1.0, -3.0, 0.0])  # block 0: amax 448
    x[0, 32:34] = torch.tensor([1.0, 0.3])  # block 1: amax 1
    x[0, 64] = 1000.0  # block 2: amax 1000
    scales, data = P.mxfp8_quantize(x)
    assert scales.dtype == torch.float8_e8m0fnu and data.dtype == torch.float8_e4m3fn
    # block 0: floor(log2 448) = 8, 8 - 8 = 0 -> X = 1, E8M0 0 + 127 = 0x7F
    # block 1: floor(log2 1) = 0, 0 - 8 = -8 -> X = 2^-8, E8M0 127 - 8 = 119 = 0x77
    # block 2: floor(log2 1000) = 9, 9 - 8 = 1 -> X = 2, E8M0 128 = 0x80
    assert _bits(scales) == [0x7F, 0x77, 0x80]
    elements = data.view(torch.uint8)[0]
    # 448 = 1.75 * 2^8: S 0, E 8+7 = 1111, M .110 -> 0 1111 110 = 0x7E
    # 1.0 = 2^0: E 0111, M 000 -> 0x38;  -3.0 = -1.5 * 2^1: S 1, E 1000, M 100 -> 0xC4;  0 -> 0x00
    assert elements[:4].tolist() == [0x7E, 0x38, 0xC4, 0x00]
    # block 1: 1.0 / 2^-8 = 256 = 2^8: E 1111, M 000 -> 0x78
    #          0.3 * 256 = 76.8 = 1.2 * 2^6 -> mantissa to the nearest 1/8: 1.25 (80): E 1101, M 010 -> 0x6A
    assert elements[32:34].tolist() == [0x78, 0x6A]
    # block 2: 1000 / 2 = 500 > 448: clamped to 448 -> 0x7E (the floor scale can overflow by < 2x)
    assert elements[64].item() == 0x7E
    back = P.mxfp8_dequantize(scales, data)[0]
    assert back[:4].tolist() == [448.0, 1.0, -3.0, 0.0]
    assert back[33].item() == 80 * 2.0 ** -8 and back[64].item() == 896.0


@needs_torchao
def test_nvfp4_bits_follow_the_nvfp4_definition():
    # NVFP4: 16 E2M1 values (codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign) share one
    # E4M3 block scale; an fp32 tensor scale ts = amax / (448 * 6) lets the block scales use
    # E4M3's range.  Block scale = round_e4m3((block amax / 6) / ts); value = round(v / (s * ts)).
    y = torch.zeros(1, 32)
    y[0, :4] = torch.tensor([6.0, 3.0, -1.5, 0.5])  # block 0: amax 6
    y[0, 16:18] = torch.tensor([0.25, 0.1])  # block 1: amax 0.25
    tensor_scale, scales, packed = P.nvfp4_quantize(y)
    assert tensor_scale.item() == pytest.approx(1 / 448)  # 6 / (448 * 6)
    assert scales.dtype == torch.float8_e4m3fn
    # block 0: (6 / 6) / (1/448) = 448 -> E4M3 0 1111 110 = 0x7E
    # block 1: (0.25 / 6) / (1/448) = 18.67 = 1.167 * 2^4 -> mantissa to 1/8: 1.125 (18): E 1011, M 001 -> 0x59
    assert _bits(scales) == [0x7E, 0x59]
    # Two codes per byte, the first in the low nibble.
    # block 0 scale 448 * ts = 1: 6 -> 7, 3 -> 5 (byte 0x57); -1.5 -> 8 | 3 = 0xB, 0.5 -> 1 (byte 0x1B)
    # block 1 scale 18 * ts = 18/448: 0.25 * 448/18 = 6.22 -> clamped to 6 -> 7;
    #         0.1 * 448/18 = 2.49 -> nearest of 2 and 3 is 2 -> 4 (byte 0x47)
    assert packed[0, :2].tolist() == [0x57, 0x1B] and packed[0, 8].item() == 0x47
    back = P.nvfp4_dequantize(tensor_scale, scales, packed)[0]
    assert back[:4].tolist() == pytest.approx([6.0, 3.0, -1.5, 0.5])
    assert back[17].item() == pytest.approx(2 * 18 / 448)


@needs_torchao
def test_block_padding_is_exact():
    # A contraction dim that is not a whole number of blocks (MTP's T-1 tokens) is zero-padded.
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    for precision in ("mxfp8", "nvfp4"):
        q = P.quantize_dequantize(x, precision)
        padded = P.quantize_dequantize(torch.nn.functional.pad(x, (0, 24)), precision)
        assert q.shape == x.shape and torch.equal(q, padded[:, :40])


# --- training ------------------------------------------------------------------------------

PRECISIONS_HERE = [p for p in P.PRECISIONS if p not in P.NEEDS_TORCHAO or P.torchao_available()]


@pytest.mark.parametrize("precision", PRECISIONS_HERE)
def test_each_precision_trains_repeatably(precision):
    cfg = _tiny(precision=precision)
    first, second = train(cfg, steps=3), train(cfg, steps=3)
    for name in first.params:
        assert _bits(first.params[name]) == _bits(second.params[name]), (precision, name)
    assert [m["loss"] for m in first.metrics] == [m["loss"] for m in second.metrics]
    assert all(m["loss"] == m["loss"] for m in first.metrics)  # not NaN


@needs_torchao
def test_low_precision_changes_the_bits_and_the_path_is_stated():
    base = train(_tiny(), steps=2)
    for precision in ("bf16", "fp8_tensorwise", "fp8_delayed", "mxfp8", "nvfp4"):
        other = train(_tiny(precision=precision), steps=2)
        assert other.metrics[0]["loss"] != base.metrics[0]["loss"], precision  # it really ran
    assert _tiny(precision="fp8_delayed").precision_gemm == "scaled_mm"  # torch 2.13 CPU has the kernel
    assert _tiny(precision="mxfp8").precision_gemm == "emulated"
    # The emulated fp8 GEMM rounds the same operands: it may differ from scaled_mm only in
    # the order of the fp32 accumulation.
    scaled = train(_tiny(precision="fp8_delayed"), steps=2)
    emulated = train(_tiny(precision="fp8_delayed", precision_gemm="emulated"), steps=2)
    assert scaled.metrics[0]["loss"] == pytest.approx(emulated.metrics[0]["loss"], rel=1e-5)


def test_bad_precision_options_say_what_to_do():
    with pytest.raises(ConfigError, match="precision='fp9' is not one of fp32"):
        _tiny(precision="fp9")
    with pytest.raises(ConfigError, match="precision_gemm='fast' is not one of native, scaled_mm, emulated"):
        _tiny(precision="fp8_delayed", precision_gemm="fast")
    assert _tiny(precision_gemm="scaled_mm").precision_gemm == "native"  # fp32 has one path
    with pytest.raises(ConfigError, match="no real GEMM here; use precision_gemm='emulated'"):
        _tiny(precision="nvfp4", precision_gemm="scaled_mm")
    # --set precision=... re-resolves the path the preset had resolved for fp32
    assert RecipeConfig().with_overrides(["precision=fp8_delayed"]).precision_gemm == "scaled_mm"


def test_stream_header_states_the_gemm_path(tmp_path):
    cfg = _tiny(precision="fp8_delayed")
    rec = samebits.Recorder(tmp_path / "run", rank=0, world_size=1, config=cfg.to_dict())
    train(cfg, steps=1, recorder=rec)
    rec.close()
    run = open_run(tmp_path / "run")
    config = run.header.config
    run.close()
    assert (config["precision"], config["precision_gemm"]) == ("fp8_delayed", "scaled_mm")


# --- FP8 delayed scaling: the amax history is state ----------------------------------------

def _resume_pair(tmp_path, save_history: bool):
    cfg = _tiny(precision="fp8_delayed", fp8_save_amax_history=save_history, dropout=0.0)
    a = samebits.Recorder(tmp_path / "a", rank=0, world_size=1, config=cfg.to_dict())
    straight = train(cfg, steps=4, recorder=a)
    a.close()
    c = samebits.Recorder(tmp_path / "c", rank=0, world_size=1, config=cfg.to_dict())
    train(cfg, steps=4, recorder=c, save_at=2, ckpt_dir=tmp_path / "ckpt")
    c.close()
    c = samebits.Recorder(tmp_path / "c", rank=0, world_size=1, config=cfg.to_dict(), append=True)
    resumed = train(cfg, steps=4, recorder=c, resume_from=tmp_path / "ckpt")
    c.close()
    # the census streams (RUN/state, beside each run's main stream), then the main streams
    census = diff(tmp_path / "a" / CENSUS_DIR, tmp_path / "c" / CENSUS_DIR, start_step=2)
    return straight, resumed, census, diff(tmp_path / "a", tmp_path / "c", start_step=2)


def test_fp8_delayed_resume_is_exact_with_the_history_checkpointed(tmp_path):
    straight, resumed, census, result = _resume_pair(tmp_path, save_history=True)
    assert result.identical and census.identical, (result.to_dict(), census.to_dict())
    for name in straight.params:
        assert _bits(straight.params[name]) == _bits(resumed.params[name]), name


def test_fp8_delayed_resume_without_the_history_diverges_and_the_census_names_it(tmp_path):
    straight, resumed, census, result = _resume_pair(tmp_path, save_history=False)
    first = census.first_divergence
    assert not census.identical and first is not None
    assert first.step == 2 and first.phase == "state", census.to_dict()
    assert first.name.startswith("fp8.") and "amax_history" in first.name
    assert not result.identical and result.first_divergence.step == 2, result.to_dict()
    # Not only the census: the weights the resumed run trains differ too.
    assert any(_bits(straight.params[n]) != _bits(resumed.params[n]) for n in straight.params)
