/* linear.c built for GGUF Q4_K blocks (quant_blocks.h): lp_pack_q4_k, lp_packed_bytes_q4_k, lp_unpack_rows_q4_k,
 * lp_linear_packed_q4_k, lp_linear_packed_side_q4_k and lp_linear_fold_q4_k (see linear.c's Semantics). */
#define LP_LINEAR_WTYPE LP_W_Q4_K
#include "linear.c"
