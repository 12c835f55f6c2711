//! What a configuration of `bench decode` costs on paper, to set its measurements against:
//! the KV bytes a decode step must read beside the weights (`LlamaConfig::weight_bytes`; the
//! two are its floor), and the arithmetic of a prefill.

use canopy_core::DType;
use canopy_model::LlamaConfig;

/// Bytes of K and V of one rank's share of a `context`-token context, every layer: what the
/// rank's attention reads in a decode step.
pub fn rank_kv_bytes(c: &LlamaConfig, dtype: DType, context: usize, ranks: usize) -> u64 {
    (context.div_ceil(ranks) * c.num_hidden_layers * 2 * c.attn_shape().kv_token_bytes(dtype))
        as u64
}

/// FLOPs of the prefill of a `tokens`-token prompt, every rank together, counted as a
/// one-rank prefill computes it: each projection's GEMM (`2·m·n·k`: q|k|v, o, gate|up, down)
/// on every token of every layer but the last, causal attention (`q·kᵀ` and `p·v`, `2·head_dim`
/// each per query head and visible key; token `i` sees `i + 1` keys) in those layers, and in
/// the last layer q|k|v on every token (its keys and values are stored) but the attention, o
/// and the MLP on the last token alone, whose logits the LM head computes: no other row of the
/// last layer is read. Norms, RoPE, SwiGLU's products and the softmax are left out: they are
/// a few FLOPs per element, not per weight.
pub fn prefill_flops(c: &LlamaConfig, tokens: usize) -> f64 {
    let (h, f, v) = (
        c.hidden_size as f64,
        c.intermediate_size as f64,
        c.vocab_size as f64,
    );
    let (q, kv) = projection_widths(c);
    let (q, kv, layers, n) = (
        q as f64,
        kv as f64,
        c.num_hidden_layers as f64,
        tokens as f64,
    );
    let qkv = 2.0 * h * (q + 2.0 * kv);
    let rest = 2.0 * (q * h + h * 2.0 * f + f * h);
    let visible_pairs = n * (n + 1.0) / 2.0;
    let attention = 4.0 * q * visible_pairs;
    let last_layer = n * qkv + rest + 4.0 * q * n;
    (layers - 1.0) * (n * (qkv + rest) + attention) + last_layer + 2.0 * h * v
}

/// Widths of the query projection and of each of the key and value projections.
fn projection_widths(c: &LlamaConfig) -> (usize, usize) {
    (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 layers, hidden 4, 2 query heads and 1 KV head of dim 2, MLP 6, vocabulary 10.
    fn tiny() -> LlamaConfig {
        LlamaConfig {
            vocab_size: 10,
            hidden_size: 4,
            intermediate_size: 6,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 2,
            ..canopy_model::presets::preset("smollm2-135m").unwrap()
        }
    }

    #[test]
    fn a_prefill_counts_its_gemms_its_one_logit_row_and_causal_attention() {
        // Per token and layer: q|k|v 2·4·(4 + 2 + 2) = 64, o 2·4·4 = 32, gate|up 2·4·12 = 96,
        // down 2·6·4 = 48: 240. The first layer: three tokens, 720, and attention over 6
        // visible (query, key) pairs × 2 heads × 2·2·2 = 96.
        // The last layer: q|k|v of three tokens, 192; o and the MLP of the last, 176; its
        // attention over 3 keys × 2 heads × 8 = 48.
        // The LM head on the last row: 2·4·10 = 80.
        assert_eq!(
            prefill_flops(&tiny(), 3),
            816.0 + 192.0 + 176.0 + 48.0 + 80.0
        );
    }

    #[test]
    fn an_8b_shape_prefills_what_llama_3_1_8b_does() {
        let c = canopy_model::presets::preset("llama-3.1-8b").unwrap();
        // 4096 tokens: 2 × 7B FLOPs a token in the layers' GEMMs (57.2 TFLOP), causal
        // attention 32 × 4 × 4096 × (4096 · 4097 / 2) (4.4 TFLOP), less the last layer's
        // attention, o and MLP (193M weights) on all but the last token: 1.7 TFLOP.
        let tflop = prefill_flops(&c, 4096) / 1e12;
        assert!((tflop - 59.86).abs() < 0.01, "{tflop}");
    }

    #[test]
    fn each_rank_reads_its_share_of_the_kv() {
        let c = tiny();
        // 2 layers × K and V × 1 head × 2 dims × 4 bytes = 32 bytes a token.
        assert_eq!(rank_kv_bytes(&c, DType::F32, 10, 1), 320);
        assert_eq!(rank_kv_bytes(&c, DType::F32, 10, 4), 3 * 32);
    }
}
