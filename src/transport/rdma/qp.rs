//! Queue pair addressing and state transitions, as plain data: what each end
//! tells the other ([`QpInfo`]) and the attributes of RESET -> INIT -> RTR ->
//! RTS ([`Transition`]), which the verbs layer copies into an `ibv_qp_attr`.

/// `ibv_qp_attr_mask` bits (verbs.h; part of the verbs ABI).
pub mod mask {
    pub const STATE: u32 = 1 << 0;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const DEST_QPN: u32 = 1 << 20;
}

/// `ibv_access_flags` bits.
pub mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 2;
}

/// `ibv_qp_state` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum QpState {
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
    Err = 6,
}

/// A port's link layer (`ibv_port_attr.link_layer`): InfiniBand routes by LID,
/// Ethernet (RoCE) by GID, through a global route header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    InfiniBand,
    Ethernet,
}

impl LinkLayer {
    /// From `IBV_LINK_LAYER_*` (0, unspecified, is InfiniBand for old providers).
    pub fn from_code(code: u8) -> Option<LinkLayer> {
        match code {
            0 | 1 => Some(LinkLayer::InfiniBand),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }
    pub fn code(self) -> u8 {
        match self {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        }
    }
}

/// Largest queue pair number and packet sequence number: both are 24 bits.
pub const MAX_QPN: u32 = (1 << 24) - 1;

/// What one end of a reliable connection tells the other: enough to move its
/// own queue pair to RTR towards it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    pub qpn: u32,
    /// The first packet sequence number this end sends with.
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// The port's active MTU as an `ibv_mtu` code (1 = 256 B ... 5 = 4096 B).
    pub mtu: u8,
    pub link: LinkLayer,
}

/// Why a peer's [`QpInfo`] cannot address a queue pair, or cannot be joined to this port's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QpInfoError {
    #[error("queue pair number {qpn} is not a 24-bit QPN above 0")]
    Qpn { qpn: u32 },
    #[error("packet sequence number {psn} is over 24 bits")]
    Psn { psn: u32 },
    #[error("MTU code {mtu} is not an ibv_mtu (1 to 5)")]
    Mtu { mtu: u8 },
    #[error("an InfiniBand port with LID 0 (no subnet manager assigned one)")]
    NoLid,
    #[error("a RoCE port with an all-zero GID")]
    ZeroGid,
    #[error("the peer's port is {peer:?} and this one {local:?}: a queue pair cannot join them")]
    LinkMismatch { peer: LinkLayer, local: LinkLayer },
}

impl QpInfo {
    /// Why a peer's info cannot address a queue pair, if it cannot.
    pub fn check(&self) -> Result<(), QpInfoError> {
        if self.qpn == 0 || self.qpn > MAX_QPN {
            return Err(QpInfoError::Qpn { qpn: self.qpn });
        }
        if self.psn > MAX_QPN {
            return Err(QpInfoError::Psn { psn: self.psn });
        }
        if !(1..=5).contains(&self.mtu) {
            return Err(QpInfoError::Mtu { mtu: self.mtu });
        }
        match self.link {
            LinkLayer::InfiniBand if self.lid == 0 => Err(QpInfoError::NoLid),
            LinkLayer::Ethernet if self.gid == [0; 16] => Err(QpInfoError::ZeroGid),
            _ => Ok(()),
        }
    }
}

/// The local port a queue pair lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    pub lid: u16,
    pub gid: [u8; 16],
    pub gid_index: u8,
    /// `ibv_mtu` code of the port's active MTU.
    pub mtu: u8,
    pub link: LinkLayer,
}

/// The address vector of RTR: how the queue pair reaches its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AddressVector {
    pub dlid: u16,
    pub port: u8,
    pub is_global: bool,
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
}

/// The attributes of one `ibv_modify_qp` call; `mask` says which the call sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub state: QpState,
    pub mask: u32,
    pub access: u32,
    pub port: u8,
    pub pkey_index: u16,
    pub path_mtu: u8,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub av: AddressVector,
}

impl Transition {
    fn new(state: QpState, mask: u32) -> Transition {
        Transition {
            state,
            mask,
            access: 0,
            port: 0,
            pkey_index: 0,
            path_mtu: 0,
            dest_qpn: 0,
            rq_psn: 0,
            sq_psn: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            max_rd_atomic: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            av: AddressVector::default(),
        }
    }
}

/// RESET -> INIT on `port`, accepting remote writes (the consumer's end is
/// written into; the producer's end needs no remote access but the same flags
/// do no harm and keep one code path).
pub fn to_init(port: u8) -> Transition {
    let mut t = Transition::new(QpState::Init, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS);
    t.port = port;
    t.access = access::LOCAL_WRITE | access::REMOTE_WRITE;
    t
}

/// Hops a RoCE packet may take (routable RoCE v2 crosses subnets).
pub const HOP_LIMIT: u8 = 64;
/// The RNR NAK timer code (12: 0.64 ms) and the ack timeout code (14: about
/// 67 ms, 4.096 us x 2^14), as perftest uses.
pub const MIN_RNR_TIMER: u8 = 12;
pub const ACK_TIMEOUT: u8 = 14;
/// 7: retry forever on receiver-not-ready (the receive ring is refilled as it
/// is consumed); transport retries, 7 at most.
pub const RETRY: u8 = 7;

/// INIT -> RTR towards `remote`: the path MTU is the smaller of both ports',
/// InfiniBand addresses the peer's LID, Ethernet its GID through a global route.
/// Refuses a peer whose info is malformed or whose link layer differs.
pub fn to_rtr(local: &PortInfo, remote: &QpInfo) -> Result<Transition, QpInfoError> {
    remote.check()?;
    if remote.link != local.link {
        return Err(QpInfoError::LinkMismatch { peer: remote.link, local: local.link });
    }
    let mut t =
        Transition::new(QpState::Rtr, mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN | mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER);
    t.path_mtu = local.mtu.min(remote.mtu);
    t.dest_qpn = remote.qpn;
    t.rq_psn = remote.psn;
    t.max_dest_rd_atomic = 1;
    t.min_rnr_timer = MIN_RNR_TIMER;
    t.av = AddressVector { dlid: remote.lid, port: local.port, ..AddressVector::default() };
    if local.link == LinkLayer::Ethernet {
        t.av.is_global = true;
        t.av.dgid = remote.gid;
        t.av.sgid_index = local.gid_index;
        t.av.hop_limit = HOP_LIMIT;
    }
    Ok(t)
}

/// RTR -> RTS, sending from `psn`.
pub fn to_rts(psn: u32) -> Transition {
    let mut t = Transition::new(QpState::Rts, mask::STATE | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::SQ_PSN | mask::MAX_QP_RD_ATOMIC);
    t.sq_psn = psn & MAX_QPN;
    t.timeout = ACK_TIMEOUT;
    t.retry_cnt = RETRY;
    t.rnr_retry = RETRY;
    t.max_rd_atomic = 1;
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(link: LinkLayer) -> PortInfo {
        PortInfo { port: 1, lid: 7, gid: [0xfe; 16], gid_index: 3, mtu: 5, link }
    }

    fn peer(link: LinkLayer) -> QpInfo {
        QpInfo { qpn: 0x1234, psn: 0xabcdef, lid: 9, gid: [0x20; 16], mtu: 3, link }
    }

    #[test]
    fn init_sets_port_pkey_and_remote_write_access() {
        let t = to_init(2);
        assert_eq!(t.state, QpState::Init);
        assert_eq!(t.mask, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS);
        assert_eq!((t.port, t.pkey_index), (2, 0));
        assert_eq!(t.access, access::LOCAL_WRITE | access::REMOTE_WRITE);
    }

    #[test]
    fn rtr_on_infiniband_addresses_the_peer_lid_at_the_smaller_mtu() {
        let t = to_rtr(&port(LinkLayer::InfiniBand), &peer(LinkLayer::InfiniBand)).unwrap();
        assert_eq!(t.state, QpState::Rtr);
        assert_eq!(t.mask, mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN | mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER);
        assert_eq!((t.dest_qpn, t.rq_psn, t.path_mtu), (0x1234, 0xabcdef, 3));
        assert_eq!(t.av, AddressVector { dlid: 9, port: 1, is_global: false, dgid: [0; 16], sgid_index: 0, hop_limit: 0 });
    }

    #[test]
    fn rtr_on_roce_routes_by_gid_through_the_chosen_gid_index() {
        let t = to_rtr(&port(LinkLayer::Ethernet), &peer(LinkLayer::Ethernet)).unwrap();
        assert!(t.av.is_global);
        assert_eq!((t.av.dgid, t.av.sgid_index, t.av.hop_limit), ([0x20; 16], 3, HOP_LIMIT));
    }

    #[test]
    fn rtr_refuses_a_peer_on_another_link_layer_or_with_a_bad_address() {
        assert!(to_rtr(&port(LinkLayer::Ethernet), &peer(LinkLayer::InfiniBand)).unwrap_err().to_string().contains("cannot join"));
        for (bad, want) in [
            (QpInfo { qpn: 0, ..peer(LinkLayer::InfiniBand) }, "queue pair number 0"),
            (QpInfo { qpn: 1 << 24, ..peer(LinkLayer::InfiniBand) }, "24-bit"),
            (QpInfo { psn: 1 << 24, ..peer(LinkLayer::InfiniBand) }, "sequence number"),
            (QpInfo { mtu: 6, ..peer(LinkLayer::InfiniBand) }, "MTU code 6"),
            (QpInfo { lid: 0, ..peer(LinkLayer::InfiniBand) }, "LID 0"),
        ] {
            assert!(to_rtr(&port(LinkLayer::InfiniBand), &bad).unwrap_err().to_string().contains(want), "{want}");
        }
        let zero_gid = QpInfo { gid: [0; 16], ..peer(LinkLayer::Ethernet) };
        assert!(to_rtr(&port(LinkLayer::Ethernet), &zero_gid).unwrap_err().to_string().contains("all-zero GID"));
    }

    #[test]
    fn rts_sends_from_the_local_psn_with_retries() {
        let t = to_rts(0x42);
        assert_eq!(t.state, QpState::Rts);
        assert_eq!(t.mask, mask::STATE | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::SQ_PSN | mask::MAX_QP_RD_ATOMIC);
        assert_eq!((t.sq_psn, t.timeout, t.retry_cnt, t.rnr_retry, t.max_rd_atomic), (0x42, ACK_TIMEOUT, 7, 7, 1));
    }
}
