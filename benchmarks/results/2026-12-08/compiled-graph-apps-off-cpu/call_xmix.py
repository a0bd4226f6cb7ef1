def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1, arg15_1, arg16_1, arg17_1, arg18_1, arg19_1, arg20_1, arg21_1, arg22_1, arg23_1, arg24_1, arg25_1, arg26_1, arg27_1, arg28_1, arg29_1, arg30_1, arg31_1, arg32_1, arg33_1, arg34_1, arg35_1, arg36_1 = args
        args.clear()
        s72 = arg0_1
        s80 = arg7_1
        buf0 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused__to_copy_embedding_note_tokens__0(arg1_1, arg2_1, buf0, s72)
        del arg2_1
        # Topologically Sorted Source Nodes: [long, output_parallel, note_tokens_], Original ATen: [aten._to_copy, aten.embedding, vllm_xmix.note_tokens_]
        torch.ops.vllm_xmix.note_tokens_.default(buf0, arg1_1)
        del arg1_1
        # Topologically Sorted Source Nodes: [hook_write_], Original ATen: [vllm_xmix.hook_write_]
        torch.ops.vllm_xmix.hook_write_.default(buf0, None, arg3_1, 0)
        del arg3_1
        buf5 = empty_strided_cpu((s72, 256), (256, 1), torch.float32)
        buf6 = empty_strided_cpu((s72, 1), (1, s72), torch.float32)
        buf7 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_1(buf0, arg4_1, buf6, buf7, s72)
        del arg4_1
        del buf6
        # Topologically Sorted Source Nodes: [pow_1, variance, add, rsqrt, x_1, x_2, onednn_mm], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf5, buf7, None, arg5_1)
        del arg5_1
        buf12 = empty_strided_cpu((s72, 4, 32), (128, 32, 1), torch.float32)
        buf10 = reinterpret_tensor(buf12, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf11 = reinterpret_tensor(buf12, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf13 = empty_strided_cpu((s72, 128), (128, 1), torch.float32)
        buf16 = reinterpret_tensor(buf7, (s72, 2, 32), (64, 32, 1), 0); del buf7  # reuse
        buf14 = reinterpret_tensor(buf16, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf15 = reinterpret_tensor(buf16, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_2(buf5, arg8_1, arg6_1, buf10, buf11, buf14, buf15, s72)
        del buf10
        del buf11
        del buf14
        del buf15
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf17 = torch.ops.vllm.unified_kv_cache_update.default(buf16, reinterpret_tensor(buf5, (s72, 2, 32), (256, 32, 1), 192), arg9_1)
        buf18 = buf17
        del buf17
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep, output_4, unified_attention_with_output], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf12, buf16, reinterpret_tensor(buf5, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf13, (s72, 4, 32), (128, 32, 1), 0), arg9_1, None, None, buf18)
        del arg9_1
        del buf12
        del buf18
        buf21 = reinterpret_tensor(buf16, (s72, 64), (64, 1), 0); del buf16  # reuse
        # Topologically Sorted Source Nodes: [output_4, unified_attention_with_output, onednn_mm_1], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf21, buf13, None, arg10_1)
        del arg10_1
        buf24 = buf5; del buf5  # reuse
        buf25 = empty_strided_cpu((s72, 1), (1, s72), torch.float32)
        buf26 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        buf33 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_hook_norm__mean_mul_onednn_mm_pow_rsqrt_3(buf21, buf0, arg11_1, buf25, buf26, buf33, s72)
        del arg11_1
        del buf0
        del buf21
        del buf25
        # Topologically Sorted Source Nodes: [x_4, pow_2, variance_1, add_4, rsqrt_1, x_5, x_6, onednn_mm_2], Original ATen: [aten.add, aten.pow, aten.mean, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf24, buf26, None, arg12_1)
        del arg12_1
        buf29 = buf26; del buf26  # reuse
        buf30 = buf13; del buf13  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_4(buf24, buf30, s72)
        # Topologically Sorted Source Nodes: [silu, x_7, onednn_mm_3], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf29, buf30, None, arg13_1)
        del arg13_1
        # Topologically Sorted Source Nodes: [x_4, hook_norm_], Original ATen: [aten.add, vllm_xmix.hook_norm_]
        torch.ops.vllm_xmix.hook_norm_.default(buf29, buf33, arg14_1, 1e-05)
        del arg14_1
        buf37 = buf24; del buf24  # reuse
        # Topologically Sorted Source Nodes: [onednn_mm_4], Original ATen: []
        torch.ops._C.onednn_mm.default(buf37, buf29, None, arg15_1)
        del arg15_1
        buf42 = reinterpret_tensor(buf30, (s72, 4, 32), (128, 32, 1), 0); del buf30  # reuse
        buf40 = reinterpret_tensor(buf42, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf41 = reinterpret_tensor(buf42, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf43 = empty_strided_cpu((s72, 128), (128, 1), torch.float32)
        buf46 = reinterpret_tensor(buf29, (s72, 2, 32), (64, 32, 1), 0); del buf29  # reuse
        buf44 = reinterpret_tensor(buf46, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf45 = reinterpret_tensor(buf46, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_2(buf37, arg8_1, arg6_1, buf40, buf41, buf44, buf45, s72)
        del buf40
        del buf41
        del buf44
        del buf45
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_1], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf47 = torch.ops.vllm.unified_kv_cache_update.default(buf46, reinterpret_tensor(buf37, (s72, 2, 32), (256, 32, 1), 192), arg16_1)
        buf48 = buf47
        del buf47
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_1, output_12, unified_attention_with_output_1], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf42, buf46, reinterpret_tensor(buf37, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf43, (s72, 4, 32), (128, 32, 1), 0), arg16_1, None, None, buf48)
        del arg16_1
        del buf48
        buf51 = reinterpret_tensor(buf46, (s72, 64), (64, 1), 0); del buf46  # reuse
        # Topologically Sorted Source Nodes: [output_12, unified_attention_with_output_1, onednn_mm_5], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf51, buf43, None, arg17_1)
        del arg17_1
        buf54 = buf37; del buf37  # reuse
        buf55 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        buf56 = empty_strided_cpu((s72, 1), (1, s72), torch.float32)
        buf57 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_5(buf51, buf33, arg18_1, buf55, buf56, buf57, s72)
        del arg18_1
        del buf33
        del buf51
        del buf56
        # Topologically Sorted Source Nodes: [pow_3, variance_2, add_8, rsqrt_2, x_10, x_11, onednn_mm_6], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf54, buf57, None, arg19_1)
        del arg19_1
        buf60 = buf57; del buf57  # reuse
        buf61 = buf43; del buf43  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_4(buf54, buf61, s72)
        # Topologically Sorted Source Nodes: [silu_1, x_12, onednn_mm_7], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf60, buf61, None, arg20_1)
        del arg20_1
        # Topologically Sorted Source Nodes: [hook_norm__1], Original ATen: [vllm_xmix.hook_norm_]
        torch.ops.vllm_xmix.hook_norm_.default(buf60, buf55, arg21_1, 1e-05)
        del arg21_1
        buf70 = buf54; del buf54  # reuse
        # Topologically Sorted Source Nodes: [onednn_mm_8], Original ATen: []
        torch.ops._C.onednn_mm.default(buf70, buf60, None, arg22_1)
        del arg22_1
        del buf60
        buf75 = reinterpret_tensor(buf61, (s72, 4, 32), (128, 32, 1), 0); del buf61  # reuse
        buf73 = reinterpret_tensor(buf75, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf74 = reinterpret_tensor(buf75, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf76 = reinterpret_tensor(buf42, (s72, 128), (128, 1), 0); del buf42  # reuse
        buf79 = empty_strided_cpu((s72, 2, 32), (64, 32, 1), torch.float32)
        buf77 = reinterpret_tensor(buf79, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf78 = reinterpret_tensor(buf79, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_2(buf70, arg8_1, arg6_1, buf73, buf74, buf77, buf78, s72)
        del buf73
        del buf74
        del buf77
        del buf78
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_2], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf80 = torch.ops.vllm.unified_kv_cache_update.default(buf79, reinterpret_tensor(buf70, (s72, 2, 32), (256, 32, 1), 192), arg23_1)
        buf81 = buf80
        del buf80
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_2, output_20, unified_attention_with_output_2], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf75, buf79, reinterpret_tensor(buf70, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf76, (s72, 4, 32), (128, 32, 1), 0), arg23_1, None, None, buf81)
        del arg23_1
        del buf81
        buf84 = reinterpret_tensor(buf79, (s72, 64), (64, 1), 0); del buf79  # reuse
        # Topologically Sorted Source Nodes: [output_20, unified_attention_with_output_2, onednn_mm_9], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf84, buf76, None, arg24_1)
        del arg24_1
        buf87 = buf70; del buf70  # reuse
        buf88 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        buf89 = empty_strided_cpu((s72, 1), (1, s72), torch.float32)
        buf90 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_5(buf84, buf55, arg25_1, buf88, buf89, buf90, s72)
        del arg25_1
        del buf55
        del buf84
        del buf89
        # Topologically Sorted Source Nodes: [pow_4, variance_3, add_12, rsqrt_3, x_15, x_16, onednn_mm_10], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf87, buf90, None, arg26_1)
        del arg26_1
        buf93 = buf90; del buf90  # reuse
        buf94 = buf76; del buf76  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_4(buf87, buf94, s72)
        # Topologically Sorted Source Nodes: [silu_2, x_17, onednn_mm_11], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf93, buf94, None, arg27_1)
        del arg27_1
        # Topologically Sorted Source Nodes: [hook_norm__2], Original ATen: [vllm_xmix.hook_norm_]
        torch.ops.vllm_xmix.hook_norm_.default(buf93, buf88, arg28_1, 1e-05)
        del arg28_1
        buf103 = buf87; del buf87  # reuse
        # Topologically Sorted Source Nodes: [onednn_mm_12], Original ATen: []
        torch.ops._C.onednn_mm.default(buf103, buf93, None, arg29_1)
        del arg29_1
        del buf93
        buf108 = reinterpret_tensor(buf94, (s72, 4, 32), (128, 32, 1), 0); del buf94  # reuse
        buf106 = reinterpret_tensor(buf108, (s72, 4, 16), (128, 32, 1), 0)  # alias
        buf107 = reinterpret_tensor(buf108, (s72, 4, 16), (128, 32, 1), 16)  # alias
        buf109 = reinterpret_tensor(buf75, (s72, 128), (128, 1), 0); del buf75  # reuse
        buf112 = empty_strided_cpu((s72, 2, 32), (64, 32, 1), torch.float32)
        buf110 = reinterpret_tensor(buf112, (s72, 2, 16), (64, 32, 1), 0)  # alias
        buf111 = reinterpret_tensor(buf112, (s72, 2, 16), (64, 32, 1), 16)  # alias
        cpp_fused_add_index_select_mul_split_split_with_sizes_sub_unsqueeze_view_2(buf103, arg8_1, arg6_1, buf106, buf107, buf110, buf111, s72)
        del arg6_1
        del arg8_1
        del buf106
        del buf107
        del buf110
        del buf111
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_3], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_kv_cache_update]
        buf113 = torch.ops.vllm.unified_kv_cache_update.default(buf112, reinterpret_tensor(buf103, (s72, 2, 32), (256, 32, 1), 192), arg30_1)
        buf114 = buf113
        del buf113
        # Topologically Sorted Source Nodes: [kv_cache_dummy_dep_3, output_28, unified_attention_with_output_3], Original ATen: [aten.split_with_sizes, aten.view, vllm.unified_attention_with_output]
        torch.ops.vllm.unified_attention_with_output.default(buf108, buf112, reinterpret_tensor(buf103, (s72, 2, 32), (256, 32, 1), 192), reinterpret_tensor(buf109, (s72, 4, 32), (128, 32, 1), 0), arg30_1, None, None, buf114)
        del arg30_1
        del buf108
        del buf114
        buf117 = reinterpret_tensor(buf112, (s72, 64), (64, 1), 0); del buf112  # reuse
        # Topologically Sorted Source Nodes: [output_28, unified_attention_with_output_3, onednn_mm_13], Original ATen: [aten.view]
        torch.ops._C.onednn_mm.default(buf117, buf109, None, arg31_1)
        del arg31_1
        buf120 = buf103; del buf103  # reuse
        buf121 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        buf122 = empty_strided_cpu((s72, 1), (1, s72), torch.float32)
        buf123 = empty_strided_cpu((s72, 64), (64, 1), torch.float32)
        cpp_fused_add_mean_mul_onednn_mm_pow_rsqrt_5(buf117, buf88, arg32_1, buf121, buf122, buf123, s72)
        del arg32_1
        del buf117
        # Topologically Sorted Source Nodes: [pow_5, variance_4, add_16, rsqrt_4, x_20, x_21, onednn_mm_14], Original ATen: [aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf120, buf123, None, arg33_1)
        del arg33_1
        buf126 = buf123; del buf123  # reuse
        buf127 = buf109; del buf109  # reuse
        cpp_fused_mul_onednn_mm_silu_slice_4(buf120, buf127, s72)
        del buf120
        # Topologically Sorted Source Nodes: [silu_3, x_22, onednn_mm_15], Original ATen: [aten.slice, aten.silu, aten.mul, _C.onednn_mm]
        torch.ops._C.onednn_mm.default(buf126, buf127, None, arg34_1)
        del arg34_1
        del buf127
        # Topologically Sorted Source Nodes: [hook_write__1], Original ATen: [vllm_xmix.hook_write_]
        torch.ops.vllm_xmix.hook_write_.default(buf121, buf126, arg35_1, 0)
        del arg35_1
        buf135 = buf122; del buf122  # reuse
        buf136 = buf88; del buf88  # reuse
        cpp_fused_add_mean_mul_pow_rsqrt_6(buf126, buf121, arg36_1, buf135, buf136, s72)
        del arg36_1
        return (buf136, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = 4096
    arg1_1 = rand_strided((4096, ), (1, ), device='cpu', dtype=torch.int32)
    arg2_1 = rand_strided((1024, 64), (64, 1), device='cpu', dtype=torch.float32)
    arg3_1 = rand_strided((1, ), (1, ), device='cpu', dtype=torch.int8)
    arg4_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg5_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg6_1 = rand_strided((1024, 32), (32, 1), device='cpu', dtype=torch.float32)
    arg7_1 = 4096
    arg8_1 = rand_strided((4096, ), (1, ), device='cpu', dtype=torch.int64)
    import pickle
    global arg9_1
    arg9_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.0.self_attn.attn\x94sb.')
    arg10_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg11_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg12_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg13_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg14_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg15_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    import pickle
    global arg16_1
    arg16_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.1.self_attn.attn\x94sb.')
    arg17_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg18_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg19_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg20_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg21_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg22_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    import pickle
    global arg23_1
    arg23_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.2.self_attn.attn\x94sb.')
    arg24_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg25_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg26_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg27_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg28_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg29_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    import pickle
    global arg30_1
    arg30_1 = pickle.loads(b'\x80\x04\x95W\x00\x00\x00\x00\x00\x00\x00\x8c\x16vllm.utils.torch_utils\x94\x8c\tLayerName\x94\x93\x94)\x81\x94}\x94\x8c\x05value\x94\x8c\x1dmodel.layers.3.self_attn.attn\x94sb.')
    arg31_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg32_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    arg33_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg34_1 = rand_strided((), (), device='cpu', dtype=torch.int64)
    arg35_1 = rand_strided((1, ), (1, ), device='cpu', dtype=torch.int8)
    arg36_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)
    return [arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1, arg15_1, arg16_1, arg17_1, arg18_1, arg19_1, arg20_1, arg21_1, arg22_1, arg23_1, arg24_1, arg25_1, arg26_1, arg27_1, arg28_1, arg29_1, arg30_1, arg31_1, arg32_1, arg33_1, arg34_1, arg35_1, arg36_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))


