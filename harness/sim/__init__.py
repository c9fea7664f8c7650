"""The simulated cluster that benches and tests share: engines (`engine`: SGLang's HTTP
protocol over continuous batching in simulated time, a prefix cache per engine), a retriever
(`retriever`), a trainer backend that sleeps for its tokens (`trainer`), all priced by one cost
model (`cost`: every number sourced). `bench/pipeline.py` runs the whole RL loop on it;
`bench/orchestrator_scale.py` loads an orchestrator with it."""
