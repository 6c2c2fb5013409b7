/* linear.c built for GGUF Q4_0 blocks (quant_blocks.h): lp_pack_q4_0, lp_packed_bytes_q4_0, lp_unpack_rows_q4_0,
 * lp_linear_packed_q4_0, lp_linear_packed_side_q4_0 and lp_linear_fold_q4_0 (see linear.c's Semantics). */
#define LP_LINEAR_WTYPE LP_W_Q4_0
#include "linear.c"
