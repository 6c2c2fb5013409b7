/* linear.c built for GGUF Q5_K blocks (quant_blocks.h): lp_pack_q5_k, lp_packed_bytes_q5_k, lp_unpack_rows_q5_k,
 * lp_linear_packed_q5_k, lp_linear_packed_side_q5_k and lp_linear_fold_q5_k (see linear.c's Semantics). */
#define LP_LINEAR_WTYPE LP_W_Q5_K
#include "linear.c"
