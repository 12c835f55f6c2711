//! Weights kept as small integer codes with a step and an offset per group of elements: the
//! form every quantized type of a model file decodes through.
//!
//! Each of ggml's quantized types gives element `i` of a group (a block, or a K-quant's
//! sub-block) as `code · step + offset` in f32, with an integer code that fits an `i8` and
//! the group's step and offset computed once from the block's scales. Kept in that form, a
//! weight reads 1.25 to 1.5 bytes an element instead of f32's 4, and [`coded_value`] gives
//! back every element's f32 bits: the CPU, whose one-row products are bound by reading the
//! weights, computes from the same values at a third of the bytes.

/// The one expression every coded element is decoded by: a model file's f32 values and a
/// coded weight's are equal bit for bit because both come from here. An offset of `-0.0`
/// leaves `code · step` as it is, sign of zero included.
#[inline(always)]
pub fn coded_value(code: i8, step: f32, offset: f32) -> f32 {
    f32::from(code) * step + offset
}

/// A part of a coded weight to be written: its elements' codes, and for each `group`
/// consecutive elements their step and offset.
pub struct CodedSliceMut<'a> {
    pub group: usize,
    pub codes: &'a mut [i8],
    pub steps: &'a mut [f32],
    pub offsets: &'a mut [f32],
}

impl<'a> CodedSliceMut<'a> {
    /// Elements in the part.
    pub fn len(&self) -> usize {
        self.codes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    /// The part cut after `elements` elements, a multiple of the group.
    pub fn split_at_mut(self, elements: usize) -> (CodedSliceMut<'a>, CodedSliceMut<'a>) {
        assert!(
            elements.is_multiple_of(self.group),
            "a coded part is cut between groups"
        );
        let groups = elements / self.group;
        let (codes, codes_after) = self.codes.split_at_mut(elements);
        let (steps, steps_after) = self.steps.split_at_mut(groups);
        let (offsets, offsets_after) = self.offsets.split_at_mut(groups);
        (
            CodedSliceMut {
                group: self.group,
                codes,
                steps,
                offsets,
            },
            CodedSliceMut {
                group: self.group,
                codes: codes_after,
                steps: steps_after,
                offsets: offsets_after,
            },
        )
    }
}

/// A part of a weight being written, in elements: in a dtype ([`crate::TypedSliceMut`]) or as
/// codes ([`CodedSliceMut`]).
pub trait WeightPart: Sized {
    /// Elements in the part.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The elements before `mid`, and those from it on.
    fn split_at_mut(self, mid: usize) -> (Self, Self);
}

impl WeightPart for crate::TypedSliceMut<'_> {
    fn len(&self) -> usize {
        crate::TypedSliceMut::len(self)
    }
    fn split_at_mut(self, mid: usize) -> (Self, Self) {
        crate::TypedSliceMut::split_at_mut(self, mid)
    }
}

impl WeightPart for CodedSliceMut<'_> {
    fn len(&self) -> usize {
        CodedSliceMut::len(self)
    }
    fn split_at_mut(self, mid: usize) -> (Self, Self) {
        CodedSliceMut::split_at_mut(self, mid)
    }
}

/// `out`, elements `first..first + out.len()` of a tensor, cut wherever the element index
/// crosses a multiple of `every` (a row's end, a task's): each part with its first element.
pub fn cut_at_multiples<P: WeightPart>(out: P, first: usize, every: usize) -> Vec<(usize, P)> {
    let end = first + out.len();
    let mut parts = Vec::with_capacity((end.div_ceil(every) - first / every).max(1));
    let (mut rest, mut at) = (out, first);
    while at < end {
        let to = end.min((at / every + 1) * every);
        let (part, after) = rest.split_at_mut(to - at);
        parts.push((at, part));
        (rest, at) = (after, to);
    }
    parts
}

/// A row-major `rows × cols` matrix of coded elements, each row a whole number of groups.
#[derive(Debug, Clone, PartialEq)]
pub struct CodedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub codes: Vec<i8>,
    pub steps: Vec<f32>,
    pub offsets: Vec<f32>,
}

impl CodedMatrix {
    /// Every code zero, every step and offset zero; `None` where a row is not a whole
    /// number of groups.
    pub fn zeros(rows: usize, cols: usize, group: usize) -> Option<CodedMatrix> {
        if group == 0 || !cols.is_multiple_of(group) {
            return None;
        }
        let groups = rows * cols / group;
        Some(CodedMatrix {
            rows,
            cols,
            group,
            codes: vec![0; rows * cols],
            steps: vec![0.0; groups],
            offsets: vec![0.0; groups],
        })
    }

    /// The whole matrix, to be written.
    pub fn slice_mut(&mut self) -> CodedSliceMut<'_> {
        CodedSliceMut {
            group: self.group,
            codes: &mut self.codes,
            steps: &mut self.steps,
            offsets: &mut self.offsets,
        }
    }

    /// Row `row`'s f32 values into `out` (`cols` long).
    #[inline(always)]
    pub fn decode_row(&self, row: usize, out: &mut [f32]) {
        let (cols, group) = (self.cols, self.group);
        let codes = &self.codes[row * cols..(row + 1) * cols];
        let first_group = row * cols / group;
        let groups = first_group..first_group + cols / group;
        let scales = self.steps[groups.clone()].iter().zip(&self.offsets[groups]);
        for ((out, codes), (&step, &offset)) in out
            .chunks_exact_mut(group)
            .zip(codes.chunks_exact(group))
            .zip(scales)
        {
            for (o, &c) in out.iter_mut().zip(codes) {
                *o = coded_value(c, step, offset);
            }
        }
    }

    /// Every element in f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        use rayon::prelude::*;
        let mut out = vec![0.0; self.rows * self.cols];
        out.par_chunks_mut(self.cols.max(1))
            .enumerate()
            .for_each(|(row, out)| self.decode_row(row, out));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows decode their own groups' steps and offsets, and a part cut between groups writes
    /// the elements and groups it covers.
    #[test]
    fn rows_decode_their_groups_and_parts_cut_between_them() {
        let mut m = CodedMatrix::zeros(3, 32, 16).unwrap();
        let (first, second) = m.slice_mut().split_at_mut(48);
        for (i, c) in first.codes.iter_mut().enumerate() {
            *c = i as i8 - 20;
        }
        first.steps.copy_from_slice(&[0.5, -0.25, 2.0]);
        first.offsets.copy_from_slice(&[1.0, -0.0, 0.125]);
        second.codes.fill(3);
        second.steps.copy_from_slice(&[1.5, 3.0, 0.0]);
        second.offsets.copy_from_slice(&[0.0, 0.0, -1.0]);
        let values = m.to_f32();
        assert_eq!(values[0], -20.0 * 0.5 + 1.0);
        assert_eq!(
            values[20].to_bits(),
            (-0.0f32).to_bits(),
            "0 × -0.25 + -0.0"
        );
        assert_eq!(values[47], 27.0 * 2.0 + 0.125);
        assert_eq!(values[48], 4.5);
        assert_eq!(values[95], -1.0);
        assert!(CodedMatrix::zeros(2, 24, 16).is_none());
    }
}
