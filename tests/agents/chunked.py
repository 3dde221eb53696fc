"""An agent whose long descriptor lists go out as pipelined chunks (TransferAgent.post_chunk), so the
conformance suite covers chunked posting on CPU (cuda_ipc uses it on GPUs)."""

from examples.custom_agent import CmaAgent


class ChunkedCmaAgent(CmaAgent):
    post_chunk = 256  # the suite's scattered tests post 2000-3000 descriptors: a first chunk of 32, then 256s
