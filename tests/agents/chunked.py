"""An agent whose long descriptor lists go out as pipelined chunks (TransferAgent.post_chunk), so the
conformance suite covers chunked posting on CPU (cuda_ipc uses it on GPUs). `posts` records the size of every
list it was asked to post (one entry per chunk), so a test can see the chunking happen."""

from examples.custom_agent import CmaAgent


class ChunkedCmaAgent(CmaAgent):
    post_chunk = 256  # the suite's scattered tests post 2000-3000 descriptors: a first chunk of 32, then 256s

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.posts: list[int] = []

    def _post(self, op, peer, local, remote):
        self.posts.append(len(local))
        return super()._post(op, peer, local, remote)
