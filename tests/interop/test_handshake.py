"""The descriptor hash matches ``durable_worker.handshake.descriptor_hash`` bit for bit.

The reference is the real SDK (0.26.1, its own virtualenv), run over
descriptors that stress each rule: legacy (absent protocol and capabilities),
an explicit empty capability list, unsorted duplicates, registrations with
and without ``onError``, and non-ASCII and astral characters (folded per
UTF-16 code unit, a surrogate pair as two units).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from durably._remote.handshake import descriptor_hash, fnv1a64

DESCRIPTORS: list[dict[str, Any]] = [
    {"instanceId": "legacy-1", "runtime": "node"},
    {
        "instanceId": "py-host-1",
        "runtime": "python",
        "sdk": {"name": "durable-worker", "version": "0.26.1"},
        "protocol": {"version": 1, "range": [1, 1]},
        "capabilities": [],
        "workflows": ["b", "a", "a"],
        "steps": ["payments:charge", "py-echo"],
        "startedAt": 1700000000000,
    },
    {
        "instanceId": "ts-h\u00e9te-7",
        "runtime": "node",
        "sdk": {"name": "@durable/core", "version": "2.1.0"},
        "protocol": {"version": 2, "range": [1, 2]},
        "capabilities": ["signals", "saga", "signals"],
        "workflows": ["r\u00e9sum\u00e9", "\U0001f680launch"],
        "steps": [],
        "registrations": [
            {"name": "z", "version": "2", "requires": ["gpu", "gpu", "cuda"]},
            {
                "name": "a",
                "group": "g",
                "onError": [{"workflow": "h"}, {"code": "x", "workflow": "h"}],
            },
        ],
        "partition": "acme",
        "namespace": "dev",
        "startedAt": 5,
    },
]

_REFERENCE = (
    "import json, sys\n"
    "from durable_worker.handshake import descriptor_hash\n"
    "print(json.dumps([descriptor_hash(d) for d in json.load(sys.stdin)]))\n"
)


def test_fnv1a64_of_ascii_is_the_bytewise_hash() -> None:
    assert fnv1a64("") == "cbf29ce484222325"
    assert fnv1a64("a") == "af63dc4c8601ec8c"  # the published FNV-1a 64 test vector


def test_descriptor_hashes_match_the_real_sdk(interop_python: Path) -> None:
    done = subprocess.run(
        [str(interop_python), "-c", _REFERENCE],
        input=json.dumps(DESCRIPTORS),
        capture_output=True,
        text=True,
        check=True,
    )
    assert [descriptor_hash(d) for d in DESCRIPTORS] == json.loads(done.stdout)
