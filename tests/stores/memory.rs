//! The memory store: the store contract on real time (Tokio's clock running), and its checks of
//! leases and lifetimes of minutes on Tokio's paused clock.

harness::store_contract!(Memory { paused_clock });
