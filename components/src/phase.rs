//! The named phases of a request. They live apart from `ecs` (which re-exports
//! them) so that `failure`, which names the phase a request failed in, imports
//! them without importing the ECS components, which in turn hold failures.

/// The phase a request is in. Named phases are what timeouts and failures report,
/// and they travel on the wire by name: an unknown name is an error, not a guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PhaseName {
    Admission,
    Compute,
    Transfer,
    Decode,
}

impl PhaseName {
    pub const ALL: [PhaseName; 4] = [PhaseName::Admission, PhaseName::Compute, PhaseName::Transfer, PhaseName::Decode];

    pub const fn name(self) -> &'static str {
        match self {
            PhaseName::Admission => "admission",
            PhaseName::Compute => "compute",
            PhaseName::Transfer => "transfer",
            PhaseName::Decode => "decode",
        }
    }
}

impl std::fmt::Display for PhaseName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A phase name that names no phase.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown phase {0:?}")]
pub struct UnknownPhase(pub String);

impl std::str::FromStr for PhaseName {
    type Err = UnknownPhase;
    fn from_str(s: &str) -> Result<Self, UnknownPhase> {
        PhaseName::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| UnknownPhase(s.to_string()))
    }
}
