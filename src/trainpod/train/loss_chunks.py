"""How the chunked loss (train/loss.py) cuts a micro-batch into chunks of rows, and which models it serves,
without torch: the loss and the estimates made on paper before a GPU is paid for (train/memory.py,
`trainpod estimate`) read the same rules.

    rows_per_chunk(32768, 16 * 1024)   # 1024: the 1b preset's micro-batch in 16 chunks
"""

from __future__ import annotations

# fp32 logits of one chunk: at least 64 MiB (512 rows at a 32k vocabulary, a matmul of 512 x width x
# 32768 that keeps a GPU busy), far below the 2 GiB of one full fp32 logits copy at 16 x 1024 tokens.
CHUNK_LOGIT_BYTES = 64 * 2**20
# torch.compile unrolls the chunk loop, and its compile time grows with the chunks: on this kit's 2-core
# CPU a loss of 8, 32 and 128 chunks took 19, 68 and 289 s to compile; on an H100's host the 125m preset
# (64 x 1024 tokens: 128 chunks of 512 rows) took 181 s for its first step against 78 s for the 1b (16 x
# 1024 tokens a micro-batch: 32 chunks), at every start of a run, spot restarts included. A micro-batch is
# therefore cut into at most this many chunks, as long as one chunk's fp32 logits stay under
# MAX_CHUNK_LOGIT_BYTES; bigger chunks are also bigger, fewer matmuls on a GPU.
MAX_CHUNKS = 16
MAX_CHUNK_LOGIT_BYTES = 512 * 2**20
# Decoders whose logits are exactly lm_head(final hidden states), which the chunked loss therefore serves: no
# soft-capping or logit scale (Gemma, Cohere, Granite have one) and no auxiliary loss (mixture-of-experts models).
PLAIN_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def rows_per_chunk(vocab_size: int, rows: int | None = None) -> int:
    """Rows of each chunk of a loss over `rows` rows (None: the least a chunk takes) at `vocab_size`."""
    least = max(1, CHUNK_LOGIT_BYTES // (4 * vocab_size))
    if rows is None:
        return least
    most = max(least, MAX_CHUNK_LOGIT_BYTES // (4 * vocab_size))
    return max(least, min(most, -(-rows // MAX_CHUNKS)))
