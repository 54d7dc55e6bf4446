# SPDX-License-Identifier: Apache-2.0
"""A GPU range for posting: descriptors converted with published costs.

Nothing here is measured by the job. Upstream reported what posting NIXL
descriptors costs on GPUs; the report converts each row's measured
descriptors per READ into a post-time range with those figures, in a table of
its own labelled PROJECTION (``forktools/bench/report.py``):

- vLLM #55841 ("[Core][Perf] Prefer contiguous KV block runs for disaggregated
  transfer"; MiniMax-M3-NVFP4, one TP2 prefill and three TP2 decode
  replicas): a representative per-rank READ posted 23,252 descriptors in
  79.6 ms (about 32 ms for 8,926-10,222 after its change): 3.42 us each.
- vLLM #55434 ("GLM-5.3 P/D on GB200 ... up to ~112k KV descriptors per
  rank-transfer"): cuda_ipc submission costs ~20x more per descriptor than
  rc_x; moving from MNNVL cuda_ipc to four-rail IB rc_x drops posting from
  56.9% of transfer time to ~15% with the descriptor count unchanged.

The range: #55841's rate as the high end, the same rate / 20 (#55434's
cuda_ipc : rc_x ratio) as the low end. #55841 does not name its transport in
the text read here; the range assumes its rate is cuda_ipc-class.
"""

from __future__ import annotations

US_PER_DESC_HIGH = 79.6e3 / 23_252  # #55841
TRANSPORT_RATIO = 20.0  # #55434: cuda_ipc vs rc_x, per descriptor
US_PER_DESC_LOW = US_PER_DESC_HIGH / TRANSPORT_RATIO

PROJECTION = {
    "label": "PROJECTION (not measured here)",
    "us_per_desc": {"low": US_PER_DESC_LOW, "high": US_PER_DESC_HIGH},
    "sources": [
        {
            "ref": "vllm-project/vllm#55841",
            "url": "https://github.com/vllm-project/vllm/pull/55841",
            "text": "a representative per-rank READ (MiniMax-M3-NVFP4, TP2 "
            "prefill + 3 TP2 decode replicas) posted 23,252 descriptors in "
            "79.6 ms: 3.42 us per descriptor (high end)",
        },
        {
            "ref": "vllm-project/vllm#55434",
            "url": "https://github.com/vllm-project/vllm/issues/55434",
            "text": "GLM-5.3 P/D on GB200, up to ~112k descriptors per "
            "rank-transfer: cuda_ipc submission ~20x more per descriptor than "
            "rc_x; posting 56.9% of transfer time on MNNVL cuda_ipc vs ~15% on "
            "rc_x (low end: 3.42 us / 20)",
        },
    ],
    "assumption": "#55841's transport is not named in its text; the range "
    "takes its rate as cuda_ipc-class and divides it by #55434's ~20x for "
    "rc_x-class transports. Posting only: bytes, completion and vLLM's own "
    "read path come on top.",
}
