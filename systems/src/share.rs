//! Who sends what to whom (docs/design.md section 4): the rule that both placement
//! (how many reports a decode rank waits for) and splitting (which copies a
//! producer plans) apply. It lives apart from both so that neither imports the
//! other for it.

/// What a producer sends a consumer: the MLA rows (one TP rank of the stage spreads
/// them: consumer tp % prefill tp), the head-split state (producer tp = consumer tp / k).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub rows: bool,
    pub state: bool,
}

/// The share of producer tp rank `producer_tp` toward decode rank `consumer_tp`.
pub fn share(prefill_tp: u32, decode_tp: u32, producer_tp: u32, consumer_tp: u32) -> Share {
    let k = (decode_tp / prefill_tp).max(1);
    Share { rows: consumer_tp % prefill_tp == producer_tp, state: consumer_tp / k == producer_tp }
}
