"""`kvbridge keys DIR [--name NAME]`: create a CurveZMQ key pair for the control plane.

Writes DIR/NAME.key (public) and DIR/NAME.key_secret (secret, mode 0600). Give every context rank the
server's secret file (transceiver.curve_secret_key_file) and a folder holding the public files of the
generation ranks allowed in (transceiver.curve_authorized_keys_dir); give every generation rank its own
secret file and the server's public file (transceiver.curve_server_public_key_file). Owns only the
writing of one pair; never reads an existing key and never sends a key anywhere.
"""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbridge keys", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--name", default="kvbridge")
    args = ap.parse_args(argv)
    import zmq.auth

    os.makedirs(args.dir, exist_ok=True)
    public, secret = zmq.auth.create_certificates(args.dir, args.name)
    os.chmod(secret, 0o600)
    print(f"public key: {public}\nsecret key: {secret}")
    return 0
