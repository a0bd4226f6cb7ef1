{   ((1, 8192), 0, 'inductor_standalone'): {   'cache_key': 'alfnveyxooi4xoscs7y4pacro5lxhv6b7iif45lmymw7tnjwrvvw',
                                               'graph_handle': (   'artifact_compile_range_1_8192_subgraph_0',
                                                                   '/root/.cache/vllm/torch_compile_cache/9f52347cfa/rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_0')},
    ((1, 8192), 1, 'inductor_standalone'): {   'cache_key': 'axwslrnbz2x3mgka7bxpdypxi53alyt2q5hmf7np5xdn2ocyhlbg',
                                               'graph_handle': (   'artifact_compile_range_1_8192_subgraph_1',
                                                                   '/root/.cache/vllm/torch_compile_cache/9f52347cfa/rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_1')},
    ((1, 8192), 32, 'inductor_standalone'): {   'cache_key': 'agl6ujcutt3n3e4e3ipkiak3yxmmp7iiybhluuijq2uf6n6zseaa',
                                                'graph_handle': (   'artifact_compile_range_1_8192_subgraph_32',
                                                                    '/root/.cache/vllm/torch_compile_cache/9f52347cfa/rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_32')}}