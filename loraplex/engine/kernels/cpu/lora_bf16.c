/* lora.c built for bf16 slot buffers: lp_lora_bf16 and lp_lora_bf16_packed (lora_weights.h). */
#define LP_LORA_WTYPE LP_W_BF16
#include "lora.c"
