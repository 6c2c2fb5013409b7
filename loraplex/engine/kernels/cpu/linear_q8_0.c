/* linear.c built for GGUF Q8_0 blocks (quant_blocks.h): lp_pack_q8_0, lp_packed_bytes_q8_0, lp_unpack_rows_q8_0,
 * lp_linear_packed_q8_0, lp_linear_packed_side_q8_0 and lp_linear_fold_q8_0 (see linear.c's Semantics). */
#define LP_LINEAR_WTYPE LP_W_Q8_0
#include "linear.c"
