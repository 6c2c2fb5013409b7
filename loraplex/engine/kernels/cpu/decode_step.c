/* A whole decode step of a Llama-family decoder on the CPU, fp32: every layer in one call.
 *
 * Semantics: the same computation as LlamaModel.forward over the per-op kernels of this directory,
 * call for call, for a batch of B single-token decodes (so results are bit-identical to that path):
 *   for each layer l (delta = none before layer 0):
 *     h += delta; x = rms_norm(h) * in_norm                       lp_add_rms_norm_f32
 *     qkv = x @ Wqkv^T (+ bias) (+ LoRA qkv)                      lp_linear_packed_side_f32, lp_lora_f32_packed
 *     rotate q and k heads of qkv at positions[b]                 lp_rope_f32
 *     with the layer's K smoothing (int8 caches): q *= s, k = (k - m) * (1 / s)   smooth_qk
 *     k_cache[slot[b]] = k, v_cache[slot[b]] = v                  lp_kv_store (rows of M_KV_TYPE)
 *     a = decode attention of q over each sequence's context      lp_decode_attention_f32
 *     o = a @ Wo^T (+ LoRA o); h += o; x = rms_norm(h) * post_norm
 *     gu = x @ Wgu^T (+ LoRA); act = silu(gate) * up; delta = act @ Wdown^T (+ LoRA down)
 *   then for each i < n_logits, row r = logits_rows[i]:
 *   logits[i] = (rms_norm(h[r] + delta[r]) * norm) @ Wlm^T.
 * Each packed projection and the LM head has its own element type (the table's L_WTYPE + module and
 * M_WTYPE, LP_W_*: fp32, bf16 or a GGUF block format, served by that build of linear.c, with LP_W_ACT8 over
 * int8 activations as linear_act8.h quantizes them: the per-op path's GEMMs, the same calls), so a merged
 * adapter's bf16 copy of some projections runs beside quantized ones, and a Q4_1 model's Q8_0 LM head
 * beside its Q4_1 projections (a Q4_K_M file's Q6_K LM head beside Q4_K ones). h [B, H] is the residual
 * stream (embedding rows in, updated in place); scratch holds the activations (decode_step_scratch_floats).
 * The model and LoRA tables are int64 blocks built once (layout below); the step block is built per call.
 * Returns 0, or a negative code and writes no K/V when a slot, block id or length is out of range.
 *
 * LoRA: at SIDE_MIN_ROWS rows or more (compute-bound GEMMs) each projection's GEMM asks for the A and
 * B rows of the step's adapters that its LoRA call reads next (lp_side_t): they come in under the
 * GEMM's FMAs, with bandwidth it leaves idle, and the LoRA call reads them from L3 instead of waiting
 * on memory (batches of many adapters are bound by reading them).
 * With a fold (the step block's slot and that slot's lora_fold.c block), that adapter's tokens take
 * their deltas inside each GEMM (lp_linear_fold_f32, at the GEMM's rate) and lora.c serves the
 * other adapters' tokens: when one adapter holds most of a batch, its LoRA costs little more than
 * its FLOPs.
 *
 * Why: at batch 1 a step is ~270 kernel calls, and their Python wrappers (argument checks, ctypes
 * conversion, tensor allocation) cost about as much as the non-GEMM work itself; here Python makes
 * one call per step and the checks are done once, when the tables are built.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "kv_types.h"

/* Model table: MODEL_FIELDS header fields, then LAYER_FIELDS per layer. */
enum { M_LAYERS, M_HIDDEN, M_HEADS, M_KV_HEADS, M_HEAD_DIM, M_INTER, M_VOCAB, M_BLOCK_SIZE, M_CACHE_SLOTS,
       M_EPS_BITS, M_ROPE_COS, M_ROPE_SIN, M_MAX_POS, M_NORM, M_LM_HEAD, M_WTYPE, M_KV_TYPE, MODEL_FIELDS };
enum { L_IN_NORM, L_QKV, L_QKV_BIAS, L_O, L_POST_NORM, L_GATE_UP, L_DOWN, L_K_CACHE, L_V_CACHE, L_KV_SMOOTH,
       L_WTYPE, /* the projections' element types, in MOD_* order (4 fields) */
       LAYER_FIELDS = L_WTYPE + 4 };
/* The LoRA table's layout is in kernels.h (LP_R_*). */
enum { LORA_MODULES = LP_LORA_MODULES, LORA_WIDTHS = LP_LORA_WIDTHS, LORA_HEADER = LP_LORA_HEADER };
enum { R_SLOTS = LP_R_SLOTS, R_RMAX = LP_R_RMAX, R_RANKS = LP_R_RANKS, R_WTYPE = LP_R_WTYPE,
       R_MODULES = LP_R_MODULES };
enum { MOD_QKV, MOD_O, MOD_GATE_UP, MOD_DOWN };
/* Below this many rows a GEMM is memory-bound: no side prefetch. */
#define SIDE_MIN_ROWS 8
/* Step block. */
enum { S_BATCH, S_H, S_POSITIONS, S_SLOTS, S_TABLES, S_MAX_BLOCKS, S_LENS, S_SCALE_BITS, S_SCRATCH, S_N_LOGITS,
       S_LOGIT_ROWS, S_LOGITS, S_LORA, S_LORA_ROWS, S_LORA_NUM_ROWS, S_LORA_GROUPS, S_LORA_NUM_GROUPS,
       S_FOLD_SLOT, S_FOLD, S_FOLD_FLOATS, STEP_FIELDS };

#define PTR(type, v) ((type)(intptr_t)(v))

static float bits_to_float(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return (float)d;
}

static int64_t model_floats(const int64_t *model, int64_t B) {
    int64_t H = model[M_HIDDEN], D = model[M_HEAD_DIM], I = model[M_INTER];
    int64_t qkv_out = (model[M_HEADS] + 2 * model[M_KV_HEADS]) * D;
    /* x, qkv, attention out, gate_up, act, delta; rounded to whole 64-byte lines */
    return (B * (H + qkv_out + model[M_HEADS] * D + 2 * I + I + H) + 15) / 16 * 16;
}

/* K smoothing (kv/smoothing.py's apply, the same fp32 operations in the same order): sm holds q's scale
 * [q_size], then K's mean and inverse scale [kv_size] each; qkv rows [B, qkv_out], q then k at the start. */
static void smooth_qk(float *qkv, int64_t B, int64_t qkv_out, int64_t q_size, int64_t kv_size, const float *sm) {
    const float *km = sm + q_size, *kinv = km + kv_size;
    for (int64_t b = 0; b < B; b++) {
        float *q = qkv + b * qkv_out, *k = q + q_size;
        for (int64_t i = 0; i < q_size; i++) q[i] *= sm[i];
        for (int64_t i = 0; i < kv_size; i++) k[i] = (k[i] - km[i]) * kinv[i];
    }
}

/* Side spans a step may ask for: up to LORA_WIDTHS + 1 per adapter (a step has at most B), and one
 * for the fold's next shrink panels. */
static int64_t side_room(int64_t B) { return B * (LORA_WIDTHS + 1) + 1; }

/* Floats of a fold's shrink rows: [B, panels of up to LORA_WIDTHS slices of r_max rows]. */
static int64_t fold_y_floats(const int64_t *lora_tab, int64_t B) {
    return B * ((LORA_WIDTHS * lora_tab[R_RMAX] + LP_NR - 1) / LP_NR * LP_NR);
}

/* The scratch a step of B rows needs (lora_tab may be NULL): the activations, then for LoRA the side
 * spans (side_room), the fold's
 * shrink rows, its row mask (B bytes) and the groups left to lora.c (B int32 triples). */
int64_t lp_decode_step_scratch_floats(const int64_t *model, const int64_t *lora_tab, int64_t B) {
    if (!lora_tab) return model_floats(model, B);
    return model_floats(model, B) + side_room(B) * 4 * 2 + fold_y_floats(lora_tab, B) + B + 3 * B;
}

/* The LoRA work of one step: the tables and the side spans' buffer. */
typedef struct {
    const int64_t *tab, *step, *model;
    int64_t *spans;
    const int32_t *groups; /* the groups lora.c serves (the step's, less the fold's) */
    int64_t num_groups;
    int64_t fold_slot, fold_rank; /* -1: no fold */
    const float *fold_next;       /* the fold block's next module */
    float *fold_y;
    const uint8_t *fold_keep;
} step_lora_t;

static const int64_t *buffers_of(const step_lora_t *lo, int64_t layer, int module) {
    return lo->tab + LORA_HEADER + (layer * LORA_MODULES + module) * 2; /* A, B */
}

/* A module's input features. */
static int64_t module_in(const int64_t *model, int module) {
    const int64_t I = model[M_INTER], q_size = model[M_HEADS] * model[M_HEAD_DIM];
    return module == MOD_O ? q_size : module == MOD_DOWN ? I : model[M_HIDDEN];
}

static int64_t clamp_rank(const step_lora_t *lo, int64_t slot) {
    const int64_t rk = PTR(const int32_t *, lo->tab[R_RANKS])[slot], r_max = lo->tab[R_RMAX];
    return rk < 0 ? 0 : rk > r_max ? r_max : rk;
}

/* out += the LoRA delta of the step's adapter tokens for one layer's module (lora.c). */
static int lora(const step_lora_t *lo, int64_t layer, int module, const float *x, float *out, int64_t T) {
    const int64_t *mod = lp_lora_module(lo->tab, module), *ab = buffers_of(lo, layer, module), *step = lo->step;
    int64_t args[15 + LORA_WIDTHS] = {
        (int64_t)(intptr_t)x, (int64_t)(intptr_t)out, T, module_in(lo->model, module), lp_lora_module_out(mod), ab[0], ab[1],
        lo->tab[R_SLOTS], lo->tab[R_RMAX], lo->tab[R_RANKS], step[S_LORA_ROWS], step[S_LORA_NUM_ROWS],
        (int64_t)(intptr_t)lo->groups, lo->num_groups, mod[0]};
    for (int64_t s = 0; s < mod[0] && s < LORA_WIDTHS; s++) args[15 + s] = mod[1 + s];
    switch (lo->tab[R_WTYPE]) {
        case LP_W_F32: return lp_lora_f32_packed(args);
        case LP_W_BF16: return lp_lora_bf16_packed(args);
        case LP_W_F16: return lp_lora_f16_packed(args);
        default: return -1;
    }
}

/* The side spans of one layer's module: for each adapter of the step, its A rows (rk of each slice)
 * and B's first rk rows (rank-major), as lora.c's shrink and expand read them. */
static lp_side_t side_spans(const step_lora_t *lo, int64_t layer, int module) {
    lp_side_t side = {.spans = lo->spans};
    if (lo->step[S_BATCH] < SIDE_MIN_ROWS) return side;
    const int64_t *mod = lp_lora_module(lo->tab, module), *ab = buffers_of(lo, layer, module);
    const int64_t K = module_in(lo->model, module), N = lp_lora_module_out(mod), r_max = lo->tab[R_RMAX], S = mod[0];
    const int64_t wb = lp_weight_bytes(lo->tab[R_WTYPE]);
    const int32_t *groups = lo->groups;
    int64_t *sp = lo->spans;
    for (int64_t g = 0; g < lo->num_groups; g++) {
        const int64_t slot = groups[3 * g];
        if (slot < 0 || slot >= lo->tab[R_SLOTS]) continue; /* (lora.c refuses the step) */
        const int64_t rk = clamp_rank(lo, slot);
        if (rk == 0 || groups[3 * g + 2] == groups[3 * g + 1]) continue;
        for (int64_t s = 0; s < S; s++, sp += 4)
            sp[0] = ab[0] + ((slot * S + s) * r_max * K) * wb, sp[1] = 1, sp[2] = 0, sp[3] = rk * K * wb;
        sp[0] = ab[1] + slot * r_max * N * wb, sp[1] = 1, sp[2] = 0, sp[3] = rk * N * wb; /* B's rk rows */
        sp += 4;
    }
    side.n = (sp - lo->spans) / 4;
    return side;
}

/* Whether linear.c has a build for this element type (with LP_W_ACT8: over int8 activations, linear_act8.h). */
static int linear_type(int64_t wtype) {
    return wtype == LP_W_F32 || wtype == LP_W_BF16 || (wtype >= LP_W_Q8_0 && wtype <= LP_W_Q6_K) ||
           (wtype >= (LP_W_Q8_0 | LP_W_ACT8) && wtype <= (LP_W_Q6_K | LP_W_ACT8));
}

/* return FN_<suffix>(args) for the build of linear.c that serves wtype */
#define BY_WTYPE(wtype, FN, ...)                                    \
    switch (wtype) {                                                \
        case LP_W_F32: return FN##_f32(__VA_ARGS__);                \
        case LP_W_BF16: return FN##_bf16(__VA_ARGS__);              \
        case LP_W_Q8_0: return FN##_q8_0(__VA_ARGS__);              \
        case LP_W_Q4_0: return FN##_q4_0(__VA_ARGS__);              \
        case LP_W_Q4_1: return FN##_q4_1(__VA_ARGS__);              \
        case LP_W_Q4_K: return FN##_q4_k(__VA_ARGS__);              \
        case LP_W_Q5_K: return FN##_q5_k(__VA_ARGS__);              \
        case LP_W_Q6_K: return FN##_q6_k(__VA_ARGS__);              \
        case LP_W_Q8_0 | LP_W_ACT8: return FN##_a8_q8_0(__VA_ARGS__); \
        case LP_W_Q4_0 | LP_W_ACT8: return FN##_a8_q4_0(__VA_ARGS__); \
        case LP_W_Q4_1 | LP_W_ACT8: return FN##_a8_q4_1(__VA_ARGS__); \
        case LP_W_Q4_K | LP_W_ACT8: return FN##_a8_q4_k(__VA_ARGS__); \
        case LP_W_Q5_K | LP_W_ACT8: return FN##_a8_q5_k(__VA_ARGS__); \
        case LP_W_Q6_K | LP_W_ACT8: return FN##_a8_q6_k(__VA_ARGS__); \
        default: return -1;                                         \
    }

/* y = x @ W^T (+ bias) over one of the model's packed weights [N, K] of element type wtype (side may be
 * NULL). */
static int project(int64_t wtype, const float *x, int64_t T, int64_t K, const void *wp, int64_t N,
                   const float *bias, float *y, const lp_side_t *side) {
    BY_WTYPE(wtype, lp_linear_packed_side, x, T, K, K, wp, N, bias, y, side)
}

/* ... with one adapter folded in (lp_linear_fold_*). */
static int project_fold(int64_t wtype, const float *x, int64_t T, int64_t K, const void *wp, int64_t N,
                        const float *bias, float *y, const lp_side_t *side, const lp_fold_t *fold) {
    BY_WTYPE(wtype, lp_linear_fold, x, T, K, K, wp, N, bias, y, side, fold)
}

/* y = x @ W^T (+ bias) for one layer's module, plus its adapter deltas when the step has any: the
 * fold's inside the GEMM, the others' by lora.c, whose weights the GEMM asks for while it runs.
 * Modules come in order (layer by layer, qkv, o, gate_up, down), as the fold block holds them. */
static int gemm(step_lora_t *lo, int64_t layer, int module, const float *x, int64_t T, const void *wp,
                int64_t N, const float *bias, float *y) {
    const int64_t K = module_in(lo->model, module);
    const int64_t wtype = lo->model[MODEL_FIELDS + layer * LAYER_FIELDS + L_WTYPE + module];
    if (!lo->tab) return project(wtype, x, T, K, wp, N, bias, y, 0);
    lp_side_t side = side_spans(lo, layer, module);
    int rc;
    if (lo->fold_slot >= 0) {
        const int64_t *mod = lp_lora_module(lo->tab, module), S = mod[0], rk = lo->fold_rank;
        const lp_fold_t fold = {.ap = lo->fold_next, .bp = lo->fold_next + lp_fold_shrink_floats(K, S, rk),
                                .pa = lp_fold_panels(S, rk), .rank = rk, .S = S, .widths = mod + 1,
                                .y = lo->fold_y, .keep = lo->fold_keep};
        lo->fold_next += lp_fold_module_floats(K, N, S, mod + 1, rk);
        /* the next module's shrink panels, which its GEMM reads first, come in under this one's FMAs */
        const int next = (module + 1) % LORA_MODULES;
        if (T >= SIDE_MIN_ROWS && (next || layer + 1 < lo->model[M_LAYERS])) {
            int64_t *sp = lo->spans + 4 * side.n++; /* (side_room counts it) */
            sp[0] = (int64_t)(intptr_t)lo->fold_next, sp[1] = 1, sp[2] = 0;
            sp[3] = lp_fold_shrink_floats(module_in(lo->model, next), lp_lora_module(lo->tab, next)[0], rk) * 4;
        }
        rc = project_fold(wtype, x, T, K, wp, N, bias, y, &side, &fold);
    } else {
        rc = project(wtype, x, T, K, wp, N, bias, y, &side);
    }
    return rc ? rc : lora(lo, layer, module, x, y, T);
}

/* The step's fold: checks it against the table, marks its rows and leaves lora.c the other groups. */
static int fold_start(step_lora_t *lo, int64_t B) {
    const int64_t *step = lo->step;
    lo->groups = PTR(const int32_t *, step[S_LORA_GROUPS]), lo->num_groups = step[S_LORA_NUM_GROUPS];
    lo->fold_slot = -1;
    if (!step[S_FOLD]) return 0;
    const int64_t slot = step[S_FOLD_SLOT];
    if (slot < 0 || slot >= lo->tab[R_SLOTS]) return -1;
    const int64_t rank = clamp_rank(lo, slot);
    int64_t ins[LORA_MODULES];
    for (int m = 0; m < LORA_MODULES; m++) ins[m] = module_in(lo->model, m);
    if (rank < 1 || step[S_FOLD_FLOATS] != lp_lora_fold_floats(lo->tab, ins, lo->model[M_LAYERS], rank))
        return -1; /* packed for another rank (or another table) */
    float *y = (float *)(lo->spans + side_room(B) * 4);
    uint8_t *keep = (uint8_t *)(y + fold_y_floats(lo->tab, B));
    int32_t *rest = (int32_t *)(keep + 4 * B); /* (keep has B floats' room: rest stays aligned) */
    const int32_t *groups = lo->groups, *rows = PTR(const int32_t *, step[S_LORA_ROWS]);
    int64_t n = 0;
    memset(keep, 0, B);
    for (int64_t g = 0; g < lo->num_groups; g++) {
        const int32_t *grp = groups + 3 * g;
        if (grp[0] != slot) {
            memcpy(rest + 3 * n++, grp, 3 * sizeof(int32_t));
            continue;
        }
        if (grp[1] < 0 || grp[2] < grp[1] || grp[2] > step[S_LORA_NUM_ROWS]) return -2;
        for (int32_t i = grp[1]; i < grp[2]; i++) {
            if (rows[i] < 0 || rows[i] >= B) return -2;
            keep[rows[i]] = 1;
        }
    }
    lo->groups = rest, lo->num_groups = n;
    lo->fold_slot = slot, lo->fold_rank = rank;
    lo->fold_next = PTR(const float *, step[S_FOLD]), lo->fold_y = y, lo->fold_keep = keep;
    return 0;
}

/* Checks every index the step will follow before anything is written. */
static int check_step(const int64_t *model, const int64_t *step) {
    int64_t B = step[S_BATCH], max_blocks = step[S_MAX_BLOCKS], bs = model[M_BLOCK_SIZE];
    int64_t slots = model[M_CACHE_SLOTS], blocks = slots / bs;
    const int64_t *slot = PTR(const int64_t *, step[S_SLOTS]), *lens = PTR(const int64_t *, step[S_LENS]);
    const int64_t *tables = PTR(const int64_t *, step[S_TABLES]), *pos = PTR(const int64_t *, step[S_POSITIONS]);
    const int64_t *rows = PTR(const int64_t *, step[S_LOGIT_ROWS]);
    if (B < 1 || max_blocks < 1 || step[S_N_LOGITS] < 0 || step[S_N_LOGITS] > B) return -1;
    if (!linear_type(model[M_WTYPE])) return -1;
    for (int64_t l = 0; l < model[M_LAYERS]; l++)
        for (int m = 0; m < LORA_MODULES; m++)
            if (!linear_type(model[MODEL_FIELDS + l * LAYER_FIELDS + L_WTYPE + m])) return -1;
    if (step[S_LORA] && (step[S_LORA_NUM_GROUPS] < 0 || step[S_LORA_NUM_GROUPS] > B)) return -1; /* scratch */
    for (int64_t b = 0; b < B; b++) {
        if (slot[b] < 0 || slot[b] >= slots || lens[b] < 1 || lens[b] > max_blocks * bs) return -2;
        if (pos[b] < 0 || pos[b] >= model[M_MAX_POS]) return -2;
        for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; j++)
            if (tables[b * max_blocks + j] < 0 || tables[b * max_blocks + j] >= blocks) return -2;
    }
    for (int64_t i = 0; i < step[S_N_LOGITS]; i++)
        if (rows[i] < 0 || rows[i] >= B) return -2;
    if (!lp_kv_valid(model[M_KV_TYPE])) return -1; /* (the cache's element type, kv_types.h) */
    return 0;
}

int lp_decode_step_f32(const int64_t *model, const int64_t *step) {
    int rc = check_step(model, step);
    if (rc) return rc;
    const int64_t B = step[S_BATCH], H = model[M_HIDDEN], nh = model[M_HEADS], kvh = model[M_KV_HEADS];
    const int64_t D = model[M_HEAD_DIM], I = model[M_INTER];
    const int64_t q_size = nh * D, kv_size = kvh * D, qkv_out = q_size + 2 * kv_size;
    const int64_t kv_type = model[M_KV_TYPE], slot_bytes = kvh * lp_kv_row_bytes((int)kv_type, D);
    const float eps = bits_to_float(model[M_EPS_BITS]), scale = bits_to_float(step[S_SCALE_BITS]);
    const float *cos_t = PTR(const float *, model[M_ROPE_COS]), *sin_t = PTR(const float *, model[M_ROPE_SIN]);
    const int64_t *pos = PTR(const int64_t *, step[S_POSITIONS]), *slot = PTR(const int64_t *, step[S_SLOTS]);
    const int64_t *tables = PTR(const int64_t *, step[S_TABLES]), *lens = PTR(const int64_t *, step[S_LENS]);
    float *h = PTR(float *, step[S_H]);
    float *x = PTR(float *, step[S_SCRATCH]);
    float *qkv = x + B * H, *attn = qkv + B * qkv_out, *gu = attn + B * q_size, *act = gu + B * 2 * I;
    float *delta = act + B * I;
    step_lora_t lo = {.tab = PTR(const int64_t *, step[S_LORA]), .step = step, .model = model};
    if (lo.tab) {
        lo.spans = (int64_t *)(x + model_floats(model, B)); /* lp_decode_step_scratch_floats' layout */
        if ((rc = fold_start(&lo, B))) return rc;
    }
    const float *prev = 0; /* the previous sublayer's output, added to h by the next norm */
    for (int64_t l = 0; l < model[M_LAYERS]; l++) {
        const int64_t *w = model + MODEL_FIELDS + l * LAYER_FIELDS;
        lp_add_rms_norm_f32(h, prev, PTR(const float *, w[L_IN_NORM]), B, H, eps, x);
        if ((rc = gemm(&lo, l, MOD_QKV, x, B, PTR(const void *, w[L_QKV]), qkv_out,
                       PTR(const float *, w[L_QKV_BIAS]), qkv)))
            return rc;
        lp_rope_f32(qkv, B, qkv_out, nh + kvh, D, pos, cos_t, sin_t);
        if (w[L_KV_SMOOTH]) smooth_qk(qkv, B, qkv_out, q_size, kv_size, PTR(const float *, w[L_KV_SMOOTH]));
        char *k_cache = PTR(char *, w[L_K_CACHE]), *v_cache = PTR(char *, w[L_V_CACHE]);
        for (int64_t b = 0; b < B; b++) { /* k, v: [slots, kv_heads] rows of M_KV_TYPE, slot_bytes a slot */
            lp_kv_store(k_cache + slot[b] * slot_bytes, qkv + b * qkv_out + q_size, kvh, D, kv_type);
            lp_kv_store(v_cache + slot[b] * slot_bytes, qkv + b * qkv_out + q_size + kv_size, kvh, D, kv_type);
        }
        if ((rc = lp_decode_attention_f32(qkv, qkv_out, k_cache, v_cache, kv_type, tables, step[S_MAX_BLOCKS], lens,
                                          B, nh, kvh, D, model[M_BLOCK_SIZE], scale, attn)))
            return rc;
        if ((rc = gemm(&lo, l, MOD_O, attn, B, PTR(const void *, w[L_O]), H, 0, delta))) return rc;
        lp_add_rms_norm_f32(h, delta, PTR(const float *, w[L_POST_NORM]), B, H, eps, x);
        if ((rc = gemm(&lo, l, MOD_GATE_UP, x, B, PTR(const void *, w[L_GATE_UP]), 2 * I, 0, gu))) return rc;
        lp_silu_mul_f32(gu, B, I, act);
        if ((rc = gemm(&lo, l, MOD_DOWN, act, B, PTR(const void *, w[L_DOWN]), H, 0, delta))) return rc;
        prev = delta;
    }
    /* the sampled rows: final residual add and norm into x's first rows, then the LM head */
    const int64_t n = step[S_N_LOGITS], *rows = PTR(const int64_t *, step[S_LOGIT_ROWS]);
    for (int64_t i = 0; i < n; i++) { /* h itself is left as it was (rows may repeat) */
        memcpy(x + i * H, h + rows[i] * H, sizeof(float) * H);
        lp_add_rms_norm_f32(x + i * H, delta + rows[i] * H, PTR(const float *, model[M_NORM]), 1, H, eps, x + i * H);
    }
    if (n == 0) return 0;
    return project(model[M_WTYPE], x, n, H, PTR(const void *, model[M_LM_HEAD]), model[M_VOCAB], 0,
                   PTR(float *, step[S_LOGITS]), 0);
}
