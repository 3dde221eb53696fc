"""bench/kernel_sweep.py builds its candidate kernels from agents/cuda_kernels.py's SOURCE by string edits:
these tests keep the sweep in step with the kernel (an edit that no longer applies fails here, on CPU, not
on the GPU host), and check that its `base` is exactly today's kernel. With NVRTC installed, every candidate
is also compiled for sm_90 (skipped otherwise, saying so)."""

from __future__ import annotations

import pytest

from kvbridge.agents.cuda_kernels import SOURCE
from kvbridge.bench import kernel_sweep as ks


def _sources() -> dict[str, str]:
    out = {}
    for v in ks.variants():
        out[v["name"]] = ks.TMA.replace("TMA_S", str(v["stages"])) if v["kind"] == "tma" else \
            ks.sm_source(**v.get("src", {}))
    return out


def test_base_is_todays_kernel():
    assert ks.repo_source() == SOURCE
    assert ks.sm_source() == SOURCE  # the default knobs edit nothing


def test_every_variant_edit_applies():
    src = _sources()
    assert src["u16"].count("copy_words<v16, 16>") == 1
    assert "ld.global.nc.L1::no_allocate.L2::256B.v2.u64" in src["nc_L2_256"]
    assert "st.global.cs.v2.u64" in src["st_cs"]
    assert "__launch_bounds__(512)" in src["t512"] and "__launch_bounds__(256, 3)" in src["lb3"]
    assert "copy_words<v32, 4>" in src["v32_u4"] and "struct alignas(16) v32" in src["v32_u4"]
    assert "kvb_copy_stream" in src["stream16"] and "v16 r[16]" in src["stream16"]
    assert "bar[4]" in src["tma_p16k_s4_c3"] and "TMA_S" not in src["tma_p16k_s4_c3"]
    names = [v["name"] for v in ks.variants()]
    assert len(names) == len(set(names))
    with pytest.raises(SystemExit, match="kernel edit failed"):
        ks.edit(SOURCE, "no such text", "x")


def test_variants_compile_for_hopper():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC bindings not installed (kvbridge[gpu])")
    try:
        nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - the bindings without libnvrtc
        pytest.skip(f"libnvrtc not loadable: {e}")
    for name, code in {**_sources(), "oracle": ks.ORACLE}.items():
        err, prog = nvrtc.nvrtcCreateProgram(code.encode(), b"k.cu", 0, [], [])
        opts = [b"--gpu-architecture=sm_90", b"-std=c++17", b"-default-device"]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        nvrtc.nvrtcDestroyProgram(prog)
        assert int(res) == 0, f"{name}: {log.decode(errors='replace')[:2000]}"
