"""msgpack encode + decode of one probe read chunk as the engine core sends it to the front end
(kv_transfer_params {"xmix": [chunk]}), with the read entry's strings in every chunk against a
per-request integer key: what a key table would save per streamed token and probe.
Run: python benchmarks/results/2026-12-07/read-chunk-codec-cpu/estimate.py > estimate.json"""
import json
import platform
import struct
import timeit

import msgspec

enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
val = struct.pack("=f", 0.123)
shapes = {"strings": {"xmix": [("probe_one", "toxicity", 16, "probe", 300, 1, 1, val)]},
          "key": {"xmix": [(3, 300, 1, val)]}}
out = {"machine": platform.processor() or platform.machine(), "msgspec": msgspec.__version__, "us": {}}
for name, obj in shapes.items():
    b = enc.encode(obj)
    e = min(timeit.repeat(lambda: enc.encode(obj), number=100000, repeat=5)) / 100000 * 1e6
    d = min(timeit.repeat(lambda: dec.decode(b), number=100000, repeat=5)) / 100000 * 1e6
    out["us"][name] = {"bytes": len(b), "encode": round(e, 3), "decode": round(d, 3), "both": round(e + d, 3)}
print(json.dumps(out, indent=1))
