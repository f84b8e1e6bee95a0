"""Fixed sizes of the MiniMax M3 NVFP4 index cache (SPEC 2, 5)."""

PAGE_SIZE = 128  # tokens per page (= block)
HEAD_DIM = 128  # index head dimension
TOPK = 16  # selected pages per query row: 15 history + the local page
SHORT_MAX_LOCAL = TOPK - 1  # rows whose local page L is at most this need no scores (SPEC 5)
GROUP_SIZE = 16  # values per E4M3 block scale (SPEC 1.3)
NUM_GROUPS = HEAD_DIM // GROUP_SIZE  # 8 scales per token
CODE_BYTES = HEAD_DIM // 2  # 64 bytes of packed E2M1 codes per token
TOKEN_BYTES = CODE_BYTES + NUM_GROUPS  # 72 bytes per token
PAGE_BYTES = PAGE_SIZE * TOKEN_BYTES  # 9216 bytes per page
SCALES_OFFSET = PAGE_SIZE * CODE_BYTES  # 8192: scales follow all codes of a page
E4M3_MAX = 448.0
E2M1_MAX = 6.0
MAX_QUERY_LEN = 8  # decode queries per request (SPEC 6)
SPEC_VERSION = "1.2"
# SPEC versions whose golden vectors stay valid: 1.1 added the engine-facing Indexer, context
# parallelism, the no-out-of-bounds rule and numpy integers; 1.2 the fp32 eps rule, metadata
# owners, outputs overlapping inputs and device comparison. No expected output changed; the
# fp32 eps changes only the float64 exact values stored with insert / query cases, which the
# ``--oracle`` check of a set written before 1.2 reports (the shipped set is written under 1.2).
GOLDEN_COMPATIBLE_SPECS = ("1.0", "1.1", "1.2")
