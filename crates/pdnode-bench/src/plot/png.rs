//! A minimal PNG writer for 8-bit RGB: each scanline gets the PNG filter (None, Sub or Up) that
//! leaves the smallest sum of residuals, then zlib (deflate) from `miniz_oxide`. Plots, mostly
//! flat background and thin lines, come out at tens of KiB instead of ~2.5 MB uncompressed.

/// zlib level: the usual default (6); higher levels save little on plots and cost time.
const LEVEL: u8 = 6;

/// Encodes `rgb` (`width * height * 3` bytes, row-major) as a PNG file.
pub fn encode_rgb(width: u32, height: u32, rgb: &[u8]) -> Option<Vec<u8>> {
    let row = (width as usize).checked_mul(3)?;
    if width == 0 || height == 0 || rgb.len() != row.checked_mul(height as usize)? {
        return None;
    }
    let raw = filter_rows(rgb, row);
    let idat = miniz_oxide::deflate::compress_to_vec_zlib(&raw, LEVEL);

    let mut out = Vec::with_capacity(idat.len() + 64);
    out.extend_from_slice(b"\x89PNG\r\n\x1a\n");
    let mut ihdr = Vec::with_capacity(13);
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit, RGB, deflate, adaptive filter, no interlace
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &idat);
    chunk(&mut out, b"IEND", &[]);
    Some(out)
}

/// Scanlines, each behind its filter type byte: 0 (None), 1 (Sub) or 2 (Up), whichever has the
/// smallest sum of residuals taken as signed bytes (the usual PNG heuristic).
fn filter_rows(rgb: &[u8], row: usize) -> Vec<u8> {
    const BPP: usize = 3;
    let mut raw = Vec::with_capacity((row + 1) * (rgb.len() / row));
    let mut sub = vec![0u8; row];
    let mut up = vec![0u8; row];
    let zero = vec![0u8; row];
    let mut prev: &[u8] = &zero;
    for line in rgb.chunks(row) {
        for i in 0..row {
            let left = if i >= BPP { line[i - BPP] } else { 0 };
            sub[i] = line[i].wrapping_sub(left);
            up[i] = line[i].wrapping_sub(prev[i]);
        }
        let cost =
            |v: &[u8]| -> u64 { v.iter().map(|&b| u64::from((b as i8).unsigned_abs())).sum() };
        let candidates: [(u8, &[u8]); 3] = [(0, line), (1, &sub), (2, &up)];
        let (kind, best) = candidates
            .into_iter()
            .min_by_key(|(_, v)| cost(v))
            .unwrap_or((0, line));
        raw.push(kind);
        raw.extend_from_slice(best);
        prev = line;
    }
    raw
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xedb8_8320 & mask);
        }
    }
    !crc
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Decodes what [`encode_rgb`] writes (one IDAT, filters 0-2) back to RGB, checking every
    /// chunk's CRC: an independent reading of the format, for the tests.
    pub(crate) fn decode_rgb(png: &[u8]) -> (u32, u32, Vec<u8>) {
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let mut at = 8;
        let (mut w, mut h, mut idat) = (0u32, 0u32, Vec::new());
        while at < png.len() {
            let len = u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
            let kind = &png[at + 4..at + 8];
            let data = &png[at + 8..at + 8 + len];
            let crc = u32::from_be_bytes(png[at + 8 + len..at + 12 + len].try_into().unwrap());
            assert_eq!(crc, crc32(&png[at + 4..at + 8 + len]), "CRC of {kind:?}");
            match kind {
                b"IHDR" => {
                    w = u32::from_be_bytes(data[..4].try_into().unwrap());
                    h = u32::from_be_bytes(data[4..8].try_into().unwrap());
                    assert_eq!(&data[8..], &[8, 2, 0, 0, 0]);
                }
                b"IDAT" => idat.extend_from_slice(data),
                b"IEND" => assert!(data.is_empty()),
                other => panic!("unexpected chunk {other:?}"),
            }
            at += 12 + len;
        }
        let raw = miniz_oxide::inflate::decompress_to_vec_zlib(&idat).expect("valid zlib");
        let row = w as usize * 3;
        assert_eq!(raw.len(), (row + 1) * h as usize);
        let mut rgb: Vec<u8> = Vec::with_capacity(row * h as usize);
        for (y, line) in raw.chunks(row + 1).enumerate() {
            for i in 0..row {
                let v = line[1 + i];
                let left = if i >= 3 { rgb[y * row + i - 3] } else { 0 };
                let up = if y > 0 { rgb[(y - 1) * row + i] } else { 0 };
                rgb.push(match line[0] {
                    0 => v,
                    1 => v.wrapping_add(left),
                    2 => v.wrapping_add(up),
                    f => panic!("filter {f} is not written"),
                });
            }
        }
        (w, h, rgb)
    }

    #[test]
    fn checksum_matches_known_value() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn encodes_a_valid_header_and_rejects_bad_sizes() {
        let png = encode_rgb(2, 1, &[255, 0, 0, 0, 255, 0]).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[12..16], b"IHDR");
        assert!(png.ends_with(&[0xae, 0x42, 0x60, 0x82])); // IEND's CRC
        assert!(encode_rgb(2, 2, &[0; 6]).is_none());
        assert!(encode_rgb(0, 2, &[]).is_none());
    }

    #[test]
    fn round_trips_through_every_filter() {
        // Noise (filter None wins), horizontal gradients (Sub) and vertical ones (Up).
        let (w, h) = (61u32, 45u32);
        let mut rgb = Vec::new();
        let mut x = 12345u32;
        for y in 0..h {
            for i in 0..w * 3 {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                rgb.push(match y % 3 {
                    0 => (x >> 16) as u8,
                    1 => (i * 7) as u8,
                    _ => (y * 5 + i % 3) as u8,
                });
            }
        }
        let png = encode_rgb(w, h, &rgb).unwrap();
        assert_eq!(decode_rgb(&png), (w, h, rgb));
    }
}
