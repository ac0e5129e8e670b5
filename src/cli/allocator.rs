//! The global allocator: mimalloc, called the way it is fastest.
//!
//! The `mimalloc` crate sends every allocation through `mi_malloc_aligned`.
//! In mimalloc v3 that call only takes a page's free list while it holds
//! blocks; otherwise, for a block size that is not a power of two, it
//! over-allocates from the next size class instead of refilling the list
//! (purpleprotocol/mimalloc_rust#170). On tollgate's request path that was
//! eight of some thirty allocations per forwarded request. Plain
//! `mi_malloc` already returns what Rust asks for whenever the alignment is
//! at most 16 and no larger than the size: mimalloc's blocks above 8 bytes
//! are multiples of 16 from a 16-aligned page start, and smaller ones are
//! 8-byte blocks. Any other layout keeps the aligned calls.
//!
//! Kept out of the library, which forbids unsafe code: each binary includes
//! this file and declares the allocator itself.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys::{
    mi_free, mi_malloc, mi_malloc_aligned, mi_realloc, mi_realloc_aligned, mi_zalloc, mi_zalloc_aligned,
};

/// The largest alignment mimalloc's plain calls guarantee
/// (`MI_MAX_ALIGN_SIZE`, alignof(max_align_t) on x86-64 and aarch64).
const PLAIN_ALIGN: usize = 16;

/// Whether a block of `size` bytes from plain `mi_malloc` has `align`.
fn plain(size: usize, align: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

/// mimalloc, through its plain calls whenever they give the alignment asked.
pub struct Mimalloc;

// SAFETY: every method hands the layout's size (and, when the plain calls
// cannot promise it, its alignment) to mimalloc, whose blocks are valid
// for that size until `mi_free`; `mi_free` and `mi_realloc*` accept blocks
// from any of the calls.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi_malloc(layout.size()) as *mut u8
            } else {
                mi_malloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if plain(layout.size(), layout.align()) {
                mi_zalloc(layout.size()) as *mut u8
            } else {
                mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: see the impl.
        unsafe { mi_free(ptr as *mut c_void) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if plain(new_size, layout.align()) {
                mi_realloc(ptr as *mut c_void, new_size) as *mut u8
            } else {
                mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_the_alignment_asked() {
        let mut blocks = Vec::new();
        for size in 1..=4096 {
            for align in [1, 2, 4, 8, 16, 32, 64] {
                let layout = Layout::from_size_align(size, align).expect("layout");
                // SAFETY: a non-zero size; freed below with the same layout.
                let p = unsafe { Mimalloc.alloc(layout) };
                assert!(!p.is_null() && (p as usize).is_multiple_of(align), "size {size} align {align}");
                blocks.push((p, layout));
            }
        }
        for (p, layout) in blocks {
            // SAFETY: allocated above with this layout.
            unsafe { Mimalloc.dealloc(p, layout) };
        }
    }
}
