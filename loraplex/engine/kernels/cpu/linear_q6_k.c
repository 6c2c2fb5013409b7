/* linear.c built for GGUF Q6_K blocks (quant_blocks.h): lp_pack_q6_k, lp_packed_bytes_q6_k, lp_unpack_rows_q6_k,
 * lp_linear_packed_q6_k, lp_linear_packed_side_q6_k and lp_linear_fold_q6_k (see linear.c's Semantics). */
#define LP_LINEAR_WTYPE LP_W_Q6_K
#include "linear.c"
