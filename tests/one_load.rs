//! The smallest whole path: one block stored and loaded back through io_uring on a file, with
//! one worker. `tools/load_walk.py` traces this test's load to list the files it passes.

mod common;

use std::sync::Arc;

use common::*;

#[test]
fn one_block_stored_and_loaded_through_one_worker() {
    let dir = scratch_dir();
    let cfg = file_config(&dir.path().join("dev.slab"), 64 << 20, 1);
    let region = region(4);
    let engine = match kvtier::Engine::open(&cfg, Arc::clone(&region)) {
        Ok(e) => e,
        Err(kvtier::Error::Ring(msg)) => {
            kvtier_sys::skip!("io_uring unavailable: {msg}");
            return;
        }
        Err(e) => panic!("open: {e}"),
    };
    let r = store(&engine, &region, 1, &[7]);
    assert!(r.success, "{r:?}");
    // The load finds the block indexed and its slot valid (the store's table write is done).
    let r = load(&engine, &region, 2, &[7]);
    assert!(r.success, "{r:?}");
    assert_eq!(r.bytes, BLOCK);
    assert!(
        holds(&region, 0, 7),
        "the loaded block holds what was stored"
    );
    let s = engine.stats();
    assert_eq!((s.loads_ok, s.loads_failed), (1, 0));
}
