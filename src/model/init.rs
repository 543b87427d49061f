//! The model a topology names: its checkpoint, else seeded weights. Apart from
//! `weights` (the types and the seeded draw) and `checkpoint` (the file), so
//! that neither imports the other's caller.

use super::ModelError;
use super::checkpoint;
use super::weights::{Dims, Model};
use handoff_components::Topology;

impl Model {
    /// The weights of the topology's `[model]` table: the `weights` file when it
    /// names one (src/model/checkpoint.rs), else seeded ([`Model::seeded`]);
    /// either way rounded as the products use them.
    pub fn new(topo: &Topology) -> Result<Model, ModelError> {
        let dims = Dims::checked(topo)?;
        match &topo.model().weights {
            Some(path) => {
                let mut model = checkpoint::load(dims, path)?;
                model.round_weights();
                Ok(model)
            }
            None => Ok(Model::seeded(dims, topo.model().seed)),
        }
    }
}
