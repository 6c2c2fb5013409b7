/* lora.c built for fp16 slot buffers: lp_lora_f16 and lp_lora_f16_packed (lora_weights.h). */
#define LP_LORA_WTYPE LP_W_F16
#include "lora.c"
