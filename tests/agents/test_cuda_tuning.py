"""The cuda_ipc agent's public launch knobs (CopyTuning): checked at construction, before a GPU is needed."""

from __future__ import annotations

import pytest

from kvbridge.agents.cuda_ipc import CopyKernel, CopyTuning, CudaIpcAgent
from kvbridge.errors import AgentError


def test_default_tuning_is_the_any_alignment_kernel_with_per_transfer_geometry():
    t = CopyTuning()
    assert (t.kernel, t.chunk, t.max_blocks) == (CopyKernel.ANY, None, None)


@pytest.mark.parametrize("kw, named", [
    (dict(chunk=256), "chunk"), (dict(chunk=(1 << 30) + 1), "chunk"), (dict(chunk=4096.0), "chunk"),
    (dict(max_blocks=0), "max_blocks"), (dict(max_blocks=True), "max_blocks"),
    (dict(kernel="aligned"), "kernel"),
])
def test_out_of_range_knobs_are_refused_naming_the_knob(kw, named):
    with pytest.raises(AgentError, match=named):
        CopyTuning(**kw)


def test_the_agent_checks_its_knobs_before_it_looks_for_a_gpu():
    with pytest.raises(AgentError, match="chunk"):
        CudaIpcAgent("bad-chunk", chunk=100)
    with pytest.raises(AgentError, match="max_blocks"):
        CudaIpcAgent("bad-blocks", max_blocks=-1)
