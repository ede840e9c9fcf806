// A scan layer's decode tokens in one call, from the row its input projection made to the row its
// output projection takes, each token's request advancing its state slot: a gated delta-net's
// (pagellm/model/delta_net.py: the convolution, SiLU, L2 norms, decay and delta-rule update, the
// read by q and the gated per-head norm) and Mamba-2's (pagellm/model/mamba2.py: the convolution,
// SiLU, time step, decay and update, the read by C, the skip by D and the gated group norm).
// Each rounds where its module's tensor ops round (to the model's dtype T after the convolution
// and the SiLU, and where the module casts; everything between in float32), so that it gives
// what the PyTorch path gives.

#include <cmath>
#include <vector>

#include "cpu_common.h"
#include "exports.h"

namespace {

template <typename T>
inline float rounded(float v) {  // v as the model's dtype holds it
    T r;
    Elem<T>::store(&r, 0, v);
    return Elem<T>::load(&r, 0);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }  // (torch's threshold)

struct DeltaNetShape {
    int64_t key_heads, value_heads, key_dim, value_dim, conv_dim, taps;
    bool tiled;  // value head h reads key head h % key_heads (else h / (value_heads / key_heads))
    int64_t key_head_of(int64_t h) const {
        return tiled ? h % key_heads : h / (value_heads / key_heads);
    }
};

// One token's convolution of C channels over its request's last K - 1 inputs (zeros where
// `fresh`), plus a bias (or none), then SiLU, into act [C] (float32, values of T); the slot's
// window moves on by this token's inputs.
template <typename T>
void convolve_token(const T* x, T* window, const T* weight, const T* bias, int64_t C, int64_t K, bool fresh,
                    float* act) {
    if (fresh) {
        for (int64_t i = 0; i < (K - 1) * C; ++i) Elem<T>::store(window, i, 0.f);
    }
    for (int64_t c = 0; c < C; ++c) {
        float acc = 0.f;
        for (int64_t j = 0; j < K - 1; ++j)
            acc += rounded<T>(Elem<T>::load(window, j * C + c) * Elem<T>::load(weight, c * K + j));
        const float xc = Elem<T>::load(x, c);
        acc += rounded<T>(xc * Elem<T>::load(weight, c * K + K - 1));
        float y = rounded<T>(acc);
        if (bias != nullptr) y = rounded<T>(y + Elem<T>::load(bias, c));
        act[c] = rounded<T>(silu(y));
    }
    for (int64_t j = 0; j + 1 < K - 1; ++j)
        for (int64_t c = 0; c < C; ++c) window[j * C + c] = window[(j + 1) * C + c];
    for (int64_t c = 0; c < C; ++c) window[(K - 2) * C + c] = x[c];
}

inline float inv_l2(const float* v, int64_t n) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += v[i] * v[i];
    return 1.f / std::sqrt(sum + 1e-6f);
}

// Value head h of one token: the state S [key_dim, value_dim] decays by exp(g), is corrected
// toward v where k reads it, and is read by q; the read, RMS-normed, scaled and gated by
// SiLU(z), goes to out [value_dim].
template <typename T>
void head_step(const float* act, const T* proj, float* S, const DeltaNetShape& s, int64_t h, float neg_a,
               float dt_bias, const T* norm_weight, float eps, bool fresh, T* out, float* scratch) {
    const int64_t dk = s.key_dim, dv = s.value_dim, kh = s.key_head_of(h);
    const int64_t key_size = s.key_heads * dk, value_size = s.value_heads * dv;
    float* q = scratch;
    float* k = scratch + dk;
    float* read = scratch + 2 * dk;
    float* o = read + dv;
    const float* qs = act + kh * dk;
    const float* ks = act + key_size + kh * dk;
    const float* v = act + 2 * key_size + h * dv;
    const float q_inv = inv_l2(qs, dk), k_inv = inv_l2(ks, dk);
    const float q_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));  // (Python's dk ** -0.5)
    for (int64_t i = 0; i < dk; ++i) {
        q[i] = qs[i] * q_inv * q_scale;
        k[i] = ks[i] * k_inv;
    }
    const T* z = proj + s.conv_dim + h * dv;
    const float beta = 1.f / (1.f + std::exp(-Elem<T>::load(proj, s.conv_dim + value_size + h)));
    const float a = Elem<T>::load(proj, s.conv_dim + value_size + s.value_heads + h);
    const float decay = std::exp(neg_a * softplus(a + dt_bias));
    if (fresh) std::fill(S, S + dk * dv, 0.f);
    std::fill(read, read + dv, 0.f);
    for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
            row[j] *= decay;
            read[j] += ki * row[j];
        }
    }
    for (int64_t j = 0; j < dv; ++j) read[j] = (v[j] - read[j]) * beta;  // (the correction u)
    std::fill(o, o + dv, 0.f);
    for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
            row[j] += ki * read[j];
            o[j] += qi * row[j];
        }
    }
    float sumsq = 0.f;
    for (int64_t j = 0; j < dv; ++j) {
        o[j] = rounded<T>(o[j]);
        sumsq += o[j] * o[j];
    }
    const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(dv) + eps);
    for (int64_t j = 0; j < dv; ++j) {
        const float scaled = rounded<T>(Elem<T>::load(norm_weight, j) * rounded<T>(o[j] * inv));
        Elem<T>::store(out, j, scaled * silu(Elem<T>::load(z, j)));
    }
}

template <typename T>
void delta_net_decode(const T* proj, int64_t proj_stride, const int64_t* rows, const int64_t* slots,
                      const uint8_t* fresh, int64_t n, T* conv_state, const T* conv_weight, float* ssm,
                      const float* neg_a, const float* dt_bias, const T* norm_weight, float eps,
                      const DeltaNetShape& s, T* out, int64_t out_stride, int num_threads) {
    const int64_t C = s.conv_dim, dk = s.key_dim, dv = s.value_dim, H = s.value_heads;
    std::vector<float> act(static_cast<size_t>(n * C));
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r)
            convolve_token<T>(proj + rows[r] * proj_stride, conv_state + slots[r] * (s.taps - 1) * C, conv_weight,
                              nullptr, C, s.taps, fresh != nullptr && fresh[r], act.data() + r * C);
        std::vector<float> scratch(static_cast<size_t>(2 * dk + 2 * dv));
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * H; ++w) {
            const int64_t r = w / H, h = w % H;
            head_step<T>(act.data() + r * C, proj + rows[r] * proj_stride, ssm + (slots[r] * H + h) * dk * dv, s, h,
                         neg_a[h], dt_bias[h], norm_weight, eps, fresh != nullptr && fresh[r],
                         out + rows[r] * out_stride + h * dv, scratch.data());
        }
    }
}

struct MambaShape {
    int64_t heads, head_dim, state_size, groups, conv_dim, taps;
    float dt_min, dt_max;
    int64_t inner() const { return heads * head_dim; }
};

// Head h of one Mamba-2 token: the state h [head_dim, state_size] decays by exp(dt a) and takes
// dt x B^T; y = h C + D x into y [head_dim] (float32).
inline void mamba_head_step(const float* act, float dt_raw, float* S, const MambaShape& s, int64_t h, float neg_a,
                            float dt_bias, float d, bool fresh, float* y) {
    const int64_t P = s.head_dim, N = s.state_size, g = h / (s.heads / s.groups);
    const float* x = act + h * P;
    const float* b = act + s.inner() + g * N;
    const float* c = act + s.inner() + s.groups * N + g * N;
    const float dt = std::min(std::max(softplus(dt_raw + dt_bias), s.dt_min), s.dt_max);
    const float decay = std::exp(dt * neg_a);
    if (fresh) std::fill(S, S + P * N, 0.f);
    for (int64_t p = 0; p < P; ++p) {
        float* row = S + p * N;
        const float in = dt * x[p];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
            row[n] = row[n] * decay + in * b[n];
            acc += row[n] * c[n];
        }
        y[p] = acc + d * x[p];
    }
}

template <typename T>
void mamba2_decode(const T* proj, int64_t proj_stride, const int64_t* rows, const int64_t* slots, const uint8_t* fresh,
                   int64_t n, T* conv_state, const T* conv_weight, const T* conv_bias, float* ssm, const float* neg_a,
                   const float* dt_bias, const float* d, const T* norm_weight, float eps, const MambaShape& s, T* out,
                   int64_t out_stride, int num_threads) {
    const int64_t C = s.conv_dim, I = s.inner(), H = s.heads, G = s.groups, P = s.head_dim;
    std::vector<float> act(static_cast<size_t>(n * C)), y(static_cast<size_t>(n * I));
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r)
            convolve_token<T>(proj + rows[r] * proj_stride + I, conv_state + slots[r] * (s.taps - 1) * C, conv_weight,
                              conv_bias, C, s.taps, fresh != nullptr && fresh[r], act.data() + r * C);
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * H; ++w) {
            const int64_t r = w / H, h = w % H;
            const float dt_raw = Elem<T>::load(proj + rows[r] * proj_stride, I + C + h);
            mamba_head_step(act.data() + r * C, dt_raw, ssm + (slots[r] * H + h) * P * s.state_size, s, h, neg_a[h],
                            dt_bias[h], d[h], fresh != nullptr && fresh[r], y.data() + r * I + h * P);
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * G; ++w) {  // gated by SiLU(gate), RMS-normed by group, scaled
            const int64_t r = w / G, width = I / G, first = (w % G) * width;
            const T* gate = proj + rows[r] * proj_stride;
            float* yr = y.data() + r * I;
            float sumsq = 0.f;
            for (int64_t i = first; i < first + width; ++i) {
                yr[i] *= silu(Elem<T>::load(gate, i));
                sumsq += yr[i] * yr[i];
            }
            const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(width) + eps);
            T* o = out + rows[r] * out_stride;
            for (int64_t i = first; i < first + width; ++i)
                Elem<T>::store(o, i, Elem<T>::load(norm_weight, i) * (yr[i] * inv));
        }
    }
}

}  // namespace

// A gated delta-net layer's n decode tokens (delta_net.py's GatedDeltaNet, see above): rows[r] is
// token r's row of proj (the fused input projection: q, k, v | z | b | a) and of out (value heads
// x value_dim; num_rows of each), slots[r] its request's state slot (of num_slots: its row of
// conv_state [slots, taps - 1, conv_dim] and of ssm [slots, value_heads, key_dim, value_dim],
// float32), fresh[r] (or null) a request starting at position 0 (from zeros). neg_a = -exp(A_log)
// and dt_bias are float32 [value heads]; conv_weight [conv_dim, taps] and norm_weight [value_dim]
// of the dtype (0 float32, 1 bf16).
int pagellm_delta_net_decode(const void* proj, int64_t proj_stride, int64_t num_rows, const int64_t* rows,
                             const int64_t* slots, int64_t num_slots, const uint8_t* fresh, int64_t n,
                             void* conv_state, const void* conv_weight, int64_t conv_dim, int64_t taps, float* ssm,
                             const float* neg_a, const float* dt_bias,
                             const void* norm_weight, float eps, int64_t key_heads, int64_t value_heads,
                             int64_t key_dim, int64_t value_dim, int tiled, void* out, int64_t out_stride, int dtype,
                             int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (n < 0 || taps < 2 || key_heads < 1 || value_heads % key_heads != 0 || key_dim < 1 || value_dim < 1 ||
        conv_dim != 2 * key_heads * key_dim + value_heads * value_dim)
        return -1;
    for (int64_t r = 0; r < n; ++r)
        if (rows[r] < 0 || rows[r] >= num_rows || slots[r] < 0 || slots[r] >= num_slots) return -2;
    const DeltaNetShape s{key_heads, value_heads, key_dim, value_dim, conv_dim, taps, tiled != 0};
    if (dtype == 0) {
        delta_net_decode<float>(static_cast<const float*>(proj), proj_stride, rows, slots, fresh, n,
                                static_cast<float*>(conv_state), static_cast<const float*>(conv_weight), ssm, neg_a,
                                dt_bias, static_cast<const float*>(norm_weight), eps, s, static_cast<float*>(out),
                                out_stride, num_threads);
    } else if (dtype == 1) {
        delta_net_decode<uint16_t>(static_cast<const uint16_t*>(proj), proj_stride, rows, slots, fresh, n,
                                   static_cast<uint16_t*>(conv_state), static_cast<const uint16_t*>(conv_weight), ssm,
                                   neg_a, dt_bias, static_cast<const uint16_t*>(norm_weight), eps, s,
                                   static_cast<uint16_t*>(out), out_stride, num_threads);
    } else {
        return -1;
    }
    return 0;
}

// A Mamba-2 layer's n decode tokens (mamba2.py's Mamba2Mixer, see above): rows, slots, fresh and
// the states as pagellm_delta_net_decode's; proj's rows hold the gate [heads x head_dim], x / B / C
// [conv_dim] and one time step a head; conv_bias may be null; neg_a = -exp(A_log), dt_bias and d
// float32 [heads]; norm_weight [heads x head_dim] of the dtype; out [heads x head_dim] a row.
int pagellm_mamba2_decode(const void* proj, int64_t proj_stride, int64_t num_rows, const int64_t* rows,
                          const int64_t* slots, int64_t num_slots, const uint8_t* fresh, int64_t n, void* conv_state,
                          const void* conv_weight, const void* conv_bias, int64_t conv_dim, int64_t taps, float* ssm,
                          const float* neg_a, const float* dt_bias, const float* d, float dt_min, float dt_max,
                          const void* norm_weight, float eps, int64_t heads, int64_t head_dim, int64_t state_size,
                          int64_t groups, void* out, int64_t out_stride, int dtype, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (n < 0 || taps < 2 || groups < 1 || heads % groups != 0 || head_dim < 1 || state_size < 1 ||
        conv_dim != heads * head_dim + 2 * groups * state_size)
        return -1;
    for (int64_t r = 0; r < n; ++r)
        if (rows[r] < 0 || rows[r] >= num_rows || slots[r] < 0 || slots[r] >= num_slots) return -2;
    const MambaShape s{heads, head_dim, state_size, groups, conv_dim, taps, dt_min, dt_max};
    if (dtype == 0) {
        mamba2_decode<float>(static_cast<const float*>(proj), proj_stride, rows, slots, fresh, n,
                             static_cast<float*>(conv_state), static_cast<const float*>(conv_weight),
                             static_cast<const float*>(conv_bias), ssm, neg_a, dt_bias, d,
                             static_cast<const float*>(norm_weight), eps, s, static_cast<float*>(out), out_stride,
                             num_threads);
    } else if (dtype == 1) {
        mamba2_decode<uint16_t>(static_cast<const uint16_t*>(proj), proj_stride, rows, slots, fresh, n,
                                static_cast<uint16_t*>(conv_state), static_cast<const uint16_t*>(conv_weight),
                                static_cast<const uint16_t*>(conv_bias), ssm, neg_a, dt_bias, d,
                                static_cast<const uint16_t*>(norm_weight), eps, s, static_cast<uint16_t*>(out),
                                out_stride, num_threads);
    } else {
        return -1;
    }
    return 0;
}
