{   ((1, 8192), 0, 'inductor_standalone'): {   'cache_key': 'awjlay5gmda3pafra3bei7pjuo35ppzqcapytu2ijd7ll5cev4ll',
                                               'graph_handle': (   'artifact_compile_range_1_8192_subgraph_0',
                                                                   '/root/.cache/vllm/torch_compile_cache/2711d9f394/rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_0')},
    ((1, 8192), 1, 'inductor_standalone'): {   'cache_key': 'a3p6dtvxn5towc3pelcjw3rjjvz4tpmmzm55eodemrassvvv7sa2',
                                               'graph_handle': (   'artifact_compile_range_1_8192_subgraph_1',
                                                                   '/root/.cache/vllm/torch_compile_cache/2711d9f394/rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_1')},
    ((1, 8192), 32, 'inductor_standalone'): {   'cache_key': 'a4pfkhfprbfjvgelmfsisujhksbanjt36pcd64sjyznptulm75bm',
                                                'graph_handle': (   'artifact_compile_range_1_8192_subgraph_32',
                                                                    '/root/.cache/vllm/torch_compile_cache/2711d9f394/rank_0_0/backbone/artifact_compile_range_1_8192_subgraph_32')}}