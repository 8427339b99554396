//! Sample decoding and preprocessing, the same at the node and on the compute tier.

use std::io::Cursor;

use candle_core::{Device, Tensor};
use image::imageops::FilterType;
use image::{ImageReader, Limits};

use crate::{Error, Result};

/// Image preprocessing: resize the shorter side to `resize`, center-crop `crop`²,
/// scale to [0, 1], subtract `mean` and divide by `std` per channel (CHW layout).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageSpec {
    /// Shorter side after resizing.
    pub(crate) resize: u32,
    /// Side of the center crop.
    pub(crate) crop: u32,
    /// Per-channel mean (RGB).
    pub mean: [f32; 3],
    /// Per-channel standard deviation (RGB).
    pub std: [f32; 3],
}

impl ImageSpec {
    /// torchvision's ImageNet evaluation transform.
    pub const IMAGENET_224: ImageSpec = ImageSpec {
        resize: 256,
        crop: 224,
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };

    /// Per-sample input shape (C, H, W).
    pub fn shape(&self) -> [usize; 3] {
        [3, self.crop as usize, self.crop as usize]
    }
}

/// How an ONNX model takes images: its input's layout and size, and the
/// normalisation the user gives (`--mean`, `--std`; defaults 0 and 1).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TensorImage {
    /// Channels first (`N,3,H,W`) or last (`N,H,W,3`).
    pub channels_last: bool,
    /// Height.
    pub height: u32,
    /// Width.
    pub width: u32,
    /// Per-channel mean (RGB), subtracted after scaling to [0, 1].
    pub mean: [f32; 3],
    /// Per-channel standard deviation (RGB).
    pub std: [f32; 3],
}

impl TensorImage {
    /// Per-sample input shape (without the batch dimension).
    pub fn shape(&self) -> Vec<usize> {
        let (h, w) = (self.height as usize, self.width as usize);
        if self.channels_last {
            vec![h, w, 3]
        } else {
            vec![3, h, w]
        }
    }
}

/// Largest image side we decode (a guard against decompression bombs).
pub(crate) const MAX_IMAGE_SIDE: u32 = 16_384;
/// Most memory one image may decode into.
pub(crate) const MAX_IMAGE_ALLOC: u64 = 256 << 20;

/// Decodes a JPEG or PNG for an ONNX model: resized (bilinear) only when its size
/// differs from the input's, scaled to [0, 1], normalised per channel, written in the
/// input's layout into `out`.
pub(crate) fn tensor_image_into(bytes: &[u8], spec: &TensorImage, out: &mut [f32]) -> Result<()> {
    let (w, h) = (spec.width as usize, spec.height as usize);
    if out.len() != 3 * w * h {
        return Err(Error::InvalidArgument(format!(
            "preprocess: output holds {} floats, need {}",
            out.len(),
            3 * w * h
        )));
    }
    let img = decode_rgb(bytes)?;
    let (sw, sh) = img.dimensions();
    let pixels: std::borrow::Cow<'_, [u8]> = if (sw, sh) == (spec.width, spec.height) {
        img.as_raw().into()
    } else {
        resize_rgb(img.as_raw(), (sw, sh), (spec.width, spec.height))?.into()
    };
    let plane = w * h;
    for (i, p) in pixels.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let v = (p[c] as f32 / 255.0 - spec.mean[c]) / spec.std[c];
            if spec.channels_last {
                out[i * 3 + c] = v;
            } else {
                out[c * plane + i] = v;
            }
        }
    }
    Ok(())
}

/// Resizes packed RGB8 pixels from `from` to `to` (width, height), bilinear, with
/// `fast_image_resize`'s SIMD kernels.
fn resize_rgb(src: &[u8], from: (u32, u32), to: (u32, u32)) -> Result<Vec<u8>> {
    use fast_image_resize::images::{Image, ImageRef};
    use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
    let failed =
        |e: &dyn std::fmt::Display| Error::InvalidArgument(format!("cannot resize image: {e}"));
    let source = ImageRef::new(from.0, from.1, src, PixelType::U8x3).map_err(|e| failed(&e))?;
    let mut out = Image::new(to.0, to.1, PixelType::U8x3);
    let bilinear = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
    Resizer::new()
        .resize(&source, &mut out, &bilinear)
        .map_err(|e| failed(&e))?;
    Ok(out.into_vec())
}

/// Decodes a batch of images for an ONNX model into one `[N, ...]` tensor (see
/// [`tensor_image_into`]), in parallel on the current rayon pool.
pub fn tensor_images(samples: &[&[u8]], spec: &TensorImage, device: &Device) -> Result<Tensor> {
    decode_batch(samples, &spec.shape(), device, |bytes, out| {
        tensor_image_into(bytes, spec, out)
    })
}

/// Decodes a JPEG or PNG to RGB within the decoding limits.
fn decode_rgb(bytes: &[u8]) -> Result<image::RgbImage> {
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_IMAGE_ALLOC);
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::InvalidArgument(format!("cannot read image: {e}")))?;
    reader.limits(limits);
    let img = reader
        .decode()
        .map_err(|e| Error::InvalidArgument(format!("cannot decode image: {e}")))?
        .into_rgb8();
    if img.width() == 0 || img.height() == 0 {
        return Err(Error::InvalidArgument("image is empty".into()));
    }
    Ok(img)
}

/// Decodes a JPEG or PNG and applies `spec`: resize the shorter side (bilinear),
/// center crop, scale to [0, 1], normalise; writes `3 × crop × crop` floats (CHW)
/// into `out`.
pub(crate) fn image_into(bytes: &[u8], spec: &ImageSpec, out: &mut [f32]) -> Result<()> {
    let side = spec.crop as usize;
    if out.len() != 3 * side * side {
        return Err(Error::InvalidArgument(format!(
            "preprocess: output holds {} floats, need {}",
            out.len(),
            3 * side * side
        )));
    }
    let img = decode_rgb(bytes)?;
    let (w, h) = img.dimensions();
    let short = w.min(h) as f64;
    let scale = spec.resize.max(spec.crop) as f64 / short;
    let (nw, nh) = (
        ((w as f64 * scale).round() as u32).max(spec.crop),
        ((h as f64 * scale).round() as u32).max(spec.crop),
    );
    let resized = image::imageops::resize(&img, nw, nh, FilterType::Triangle);
    let (x0, y0) = ((nw - spec.crop) / 2, (nh - spec.crop) / 2);
    let plane = side * side;
    for y in 0..side {
        for x in 0..side {
            let p = resized.get_pixel(x0 + x as u32, y0 + y as u32).0;
            for c in 0..3 {
                out[c * plane + y * side + x] = (p[c] as f32 / 255.0 - spec.mean[c]) / spec.std[c];
            }
        }
    }
    Ok(())
}

/// Decodes and preprocesses a batch of images into one `[N, 3, crop, crop]` tensor.
/// Images are decoded in parallel on the current rayon pool.
pub fn images(samples: &[&[u8]], spec: &ImageSpec, device: &Device) -> Result<Tensor> {
    decode_batch(samples, &spec.shape(), device, |bytes, out| {
        image_into(bytes, spec, out)
    })
}

/// Decodes `samples` with `one` in parallel on the current rayon pool into one
/// `[N, shape…]` tensor; an error names the sample.
fn decode_batch(
    samples: &[&[u8]],
    shape: &[usize],
    device: &Device,
    one: impl Fn(&[u8], &mut [f32]) -> Result<()> + Sync,
) -> Result<Tensor> {
    use rayon::prelude::*;
    let per: usize = shape.iter().product();
    let mut buf = vec![0f32; samples.len() * per];
    buf.par_chunks_mut(per)
        .zip(samples.par_iter())
        .enumerate()
        .try_for_each(|(i, (out, bytes))| {
            one(bytes, out).map_err(|e| match e {
                Error::InvalidArgument(m) => {
                    Error::InvalidArgument(format!("sample {i} of the batch: {m}"))
                }
                other => other,
            })
        })?;
    let mut dims = vec![samples.len()];
    dims.extend_from_slice(shape);
    Ok(Tensor::from_vec(buf, dims, device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x % 256) as u8, (y % 256) as u8, 128])
        });
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)
            .expect("encode png");
        out
    }

    #[test]
    fn resizes_crops_and_normalises() {
        let spec = ImageSpec {
            resize: 8,
            crop: 4,
            mean: [0.5; 3],
            std: [0.5; 3],
        };
        let mut out = vec![0f32; 48];
        image_into(&png(16, 32), &spec, &mut out).expect("decodes");
        // Blue is 128 everywhere: (128/255 - 0.5) / 0.5.
        let blue = (128.0 / 255.0 - 0.5) / 0.5;
        assert!(out[32..].iter().all(|v| (v - blue).abs() < 1e-6));
        assert!(out.iter().all(|v| (-1.0..=1.0).contains(v)));
    }

    #[test]
    fn onnx_images_resize_only_when_needed_in_either_layout() {
        let spec = TensorImage {
            channels_last: false,
            height: 4,
            width: 6,
            mean: [0.0; 3],
            std: [1.0; 3],
        };
        let mut chw = vec![0f32; 72];
        tensor_image_into(&png(6, 4), &spec, &mut chw).expect("decodes");
        // Same size: the pixels as they are (red = x, green = y, blue = 128).
        assert_eq!(chw[5], 5.0 / 255.0);
        assert_eq!(chw[24 + 6 * 3], 3.0 / 255.0);
        assert_eq!(chw[48], 128.0 / 255.0);
        let mut hwc = vec![0f32; 72];
        let last = TensorImage {
            channels_last: true,
            ..spec
        };
        tensor_image_into(&png(6, 4), &last, &mut hwc).expect("decodes");
        assert_eq!(hwc[(3 * 6 + 5) * 3], 5.0 / 255.0);
        assert_eq!(hwc[(3 * 6 + 5) * 3 + 1], 3.0 / 255.0);
        // Another size is resized to the input's; normalisation applies.
        let norm = TensorImage {
            mean: [0.5; 3],
            std: [0.5; 3],
            ..spec
        };
        tensor_image_into(&png(60, 40), &norm, &mut chw).expect("decodes");
        let blue = (128.0 / 255.0 - 0.5) / 0.5;
        assert!(chw[48..].iter().all(|v| (v - blue).abs() < 1e-6));
        let e = tensor_image_into(b"nope", &spec, &mut chw)
            .unwrap_err()
            .to_string();
        assert!(e.contains("image"), "{e}");
    }

    #[test]
    fn bad_bytes_are_a_clear_error() {
        let spec = ImageSpec::IMAGENET_224;
        let mut out = vec![0f32; 3 * 224 * 224];
        let e = image_into(b"definitely not an image", &spec, &mut out).unwrap_err();
        assert!(e.to_string().contains("image"), "{e}");
        let t = images(
            &[&png(300, 300), b"\x89PNG\r\n\x1a\ntruncated"],
            &spec,
            &Device::Cpu,
        );
        let e = t.unwrap_err().to_string();
        assert!(e.contains("sample 1"), "{e}");
    }
}
