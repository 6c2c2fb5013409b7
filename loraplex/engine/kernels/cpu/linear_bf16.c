/* linear.c built for bf16 weight panels: lp_pack_bf16, lp_linear_packed_bf16, lp_linear_packed_side_bf16
 * and lp_linear_fold_bf16 (see linear.c's Semantics). */
#define LP_LINEAR_WTYPE LP_W_BF16
#include "linear.c"
