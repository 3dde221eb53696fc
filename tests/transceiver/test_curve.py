"""CurveZMQ on the control plane: authorized generation ranks pull; anyone else is rejected and logged."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvbridge.cli import main as cli
from kvbridge.formatter.layout import KVLayout, KVShape
from kvbridge.formatter.verify import pool_image
from kvbridge.transceiver import CacheTransceiver, DisaggParams, TransceiverConfig

LAY = KVLayout(KVShape(2, 2, 8, "float32", 16))


class _Req:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def keys(tmp_path):
    for name, where in (("server", "server"), ("gen", "allowed"), ("intruder", "other")):
        assert cli(["keys", str(tmp_path / where), "--name", name]) == 0
    return tmp_path


def _pull(ctx, gen_cfg, rid, secret):
    gen_buf = pool_image(LAY, 0, 8, [], 9).copy()
    with CacheTransceiver.generation(gen_buf, LAY, 0, 8, gen_cfg) as gen:
        gen.request_and_receive_async(_Req(request_id=rid, block_ids=np.array([3, 4]), num_tokens=20,
                                           disagg_params=DisaggParams(rid, ctx.instance, (ctx.endpoint,), LAY,
                                                                        secret)))
        (r,) = gen.check_gen_transfer_status(1, timeout_s=20)
    return r, gen_buf


def test_only_authorized_generation_ranks_get_through(keys, caplog):
    server = TransceiverConfig(agents=("nixl",), curve_secret_key_file=str(keys / "server/server.key_secret"),
                               curve_authorized_keys_dir=str(keys / "allowed"), handshake_timeout_s=1.5)
    ctx_buf = pool_image(LAY, 0, 8, [([1, 2], 20, 5), ([5, 6], 20, 6)]).copy()
    with CacheTransceiver.context(ctx_buf, LAY, 0, 8, server) as ctx:
        secrets = {rid: ctx.respond_and_send_async(_Req(request_id=rid, block_ids=np.array(blocks), num_tokens=20))
                   for rid, blocks in ((1, [1, 2]), (2, [5, 6]))}
        good = TransceiverConfig(agents=("nixl",), curve_secret_key_file=str(keys / "allowed/gen.key_secret"),
                                 curve_server_public_key_file=str(keys / "server/server.key"))
        r, buf = _pull(ctx, good, 1, secrets[1])
        assert r.ok, r.error
        np.testing.assert_array_equal(buf, pool_image(LAY, 0, 8, [([3, 4], 20, 5)], 9))

        with caplog.at_level(logging.DEBUG, logger="kvbridge.auth"):
            bad = TransceiverConfig(agents=("nixl",), handshake_timeout_s=1.5,
                                    curve_secret_key_file=str(keys / "other/intruder.key_secret"),
                                    curve_server_public_key_file=str(keys / "server/server.key"))
            r, buf = _pull(ctx, bad, 2, secrets[2])
            assert not r.ok and r.error_type == "PeerGone" and "did not answer hello" in r.error
            np.testing.assert_array_equal(buf, pool_image(LAY, 0, 8, [], 9))  # nothing arrived
            plain = TransceiverConfig(agents=("nixl",), handshake_timeout_s=1.5)
            r, _ = _pull(ctx, plain, 2, secrets[2])
            assert not r.ok and "did not answer hello" in r.error
        assert any("refused a peer at 127.0.0.1: CURVE key" in m for m in caplog.messages), caplog.messages

        r, _ = _pull(ctx, good, 2, secrets[2])  # still serving authorized peers
        assert r.ok, r.error


def test_missing_key_files_are_named():
    from kvbridge.transceiver.config import ConfigError

    cfg = TransceiverConfig(curve_secret_key_file="/nonexistent/server.key_secret", curve_authorized_keys_dir="/tmp")
    with pytest.raises(ConfigError, match="cannot read CurveZMQ key file /nonexistent/server.key_secret"):
        CacheTransceiver.context(pool_image(LAY, 0, 8, []).copy(), LAY, 0, 8, cfg)
