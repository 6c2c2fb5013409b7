/* linear.c built for GGUF Q4_1 blocks (quant_blocks.h): lp_pack_q4_1, lp_packed_bytes_q4_1, lp_unpack_rows_q4_1,
 * lp_linear_packed_q4_1, lp_linear_packed_side_q4_1 and lp_linear_fold_q4_1 (see linear.c's Semantics). */
#define LP_LINEAR_WTYPE LP_W_Q4_1
#include "linear.c"
