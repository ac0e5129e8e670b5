//! Where WebSocket frames begin in a tunnel's byte stream (RFC 6455 §5.2):
//! a tunnel closed at the end of the drain gets a close frame from tollgate
//! itself, and that frame may only go between two of the peers' frames.
//! Only frame heads are read; payloads are counted past, unread.

use std::time::Instant;

/// The close frame tollgate sends a client: code 1001, going away (a
/// server's frames are not masked).
pub(super) const GOING_AWAY_TO_CLIENT: [u8; 4] = [0x88, 0x02, 0x03, 0xE9];

/// The close frame tollgate sends an upstream in the client's place: code
/// 1001, masked as a client's frames must be.
pub(super) fn going_away_to_upstream() -> [u8; 8] {
    use std::hash::BuildHasher;
    // Unpredictable enough for a two-byte frame; no cryptographic need.
    let key = std::collections::hash_map::RandomState::new().hash_one(Instant::now()).to_be_bytes();
    [0x88, 0x82, key[0], key[1], key[2], key[3], 0x03 ^ key[0], 0xE9 ^ key[1]]
}

/// Frame boundaries of the bytes written one way through a tunnel.
#[derive(Debug, Default)]
pub(super) struct FrameEdge {
    /// The head of the frame being written, as far as it has come (a head
    /// is at most 14 bytes).
    head: [u8; 14],
    have: usize,
    /// Payload bytes of the current frame still to come.
    remaining: u64,
}

impl FrameEdge {
    /// Notes `bytes`, written after everything fed so far.
    pub(super) fn feed(&mut self, mut bytes: &[u8]) {
        while let Some((&first, rest)) = bytes.split_first() {
            if self.remaining > 0 {
                let skip = usize::try_from(self.remaining).unwrap_or(usize::MAX).min(bytes.len());
                self.remaining -= skip as u64;
                bytes = &bytes[skip..];
                continue;
            }
            self.head[self.have] = first;
            self.have += 1;
            bytes = rest;
            if self.have >= 2 && self.have == head_len(self.head[1]) {
                self.remaining = payload_len(&self.head[..self.have]);
                self.have = 0;
            }
        }
    }

    /// Whether the bytes fed so far end with a whole frame.
    pub(super) fn at_edge(&self) -> bool {
        self.have == 0 && self.remaining == 0
    }
}

/// A frame head's length, from its second byte: the mask bit and the
/// payload length's form.
fn head_len(second: u8) -> usize {
    let extended = match second & 0x7F {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    let mask = if second & 0x80 != 0 { 4 } else { 0 };
    2 + extended + mask
}

/// The payload length a whole head announces.
fn payload_len(head: &[u8]) -> u64 {
    match head[1] & 0x7F {
        126 => u64::from(u16::from_be_bytes([head[2], head[3]])),
        127 => head[2..10].iter().fold(0, |n, b| n << 8 | u64::from(*b)),
        n => u64::from(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unmasked frame of `len` payload bytes.
    fn frame(len: usize) -> Vec<u8> {
        let mut f = vec![0x82];
        match len {
            0..=125 => f.push(len as u8),
            126..=65535 => {
                f.push(126);
                f.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                f.push(127);
                f.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        f.extend(std::iter::repeat_n(7u8, len));
        f
    }

    #[test]
    fn edges_are_found_whatever_the_pieces_the_bytes_come_in() {
        let stream: Vec<u8> = [frame(0), frame(5), frame(300), frame(70_000), frame(125)].concat();
        for piece in [1, 2, 3, 7, 1000, stream.len()] {
            let mut edge = FrameEdge::default();
            let mut edges = 0;
            for chunk in stream.chunks(piece) {
                edge.feed(chunk);
                edges += usize::from(edge.at_edge());
            }
            assert!(edge.at_edge(), "piece {piece}");
            if piece == 1 {
                // Byte by byte, every frame's end is seen.
                assert_eq!(edges, 5);
            }
        }
    }

    #[test]
    fn a_masked_frame_and_a_frame_cut_short() {
        let mut edge = FrameEdge::default();
        edge.feed(&going_away_to_upstream());
        assert!(edge.at_edge());
        edge.feed(&frame(10)[..6]);
        assert!(!edge.at_edge());
        edge.feed(&GOING_AWAY_TO_CLIENT[..1]);
        assert!(!edge.at_edge());
    }
}
